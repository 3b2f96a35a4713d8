"""How late the event loop runs: a task that asks to wake every ``interval_s`` and records how much later it woke.

Requests, the engines' health polls, gossip and KV-event ingest share one trio loop per replica. When
something holds the loop (a long ingest slice, a large body parsed in place, a garbage collection), every
one of them waits about as long as this task overslept. Exported as a histogram, overload shows up as a
metric before it shows up as slow answers, and a benchmark can tell a replica's own stalls from a machine
that has no core free for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import trio

INTERVAL_S = 0.05
"""Twenty wake-ups a second: too few to cost anything, enough to catch a 10 ms stall within a second."""


async def watch_loop_lag(observe: Callable[[float], None], interval_s: float = INTERVAL_S) -> NoReturn:
    """Forever: sleep ``interval_s``, then report by how much the wake-up came late (never negative)."""
    while True:
        asked = trio.current_time() + interval_s
        await trio.sleep_until(asked)
        observe(max(0.0, trio.current_time() - asked))
