"""Which of an engine's /metrics poll ticks are worth a poll: every one while the engine may be busy, every few
while it is quiet.

A poll costs the router 0.5-0.7 ms of CPU and the engine a render of its whole Prometheus page, once per engine per
interval, so an idle router's polls grow with the fleet (2.3-2.7 ms per engine a second measured in front of 64
simulated engines, most of it polls), and a router that keeps a few hot engines busy polls the rest of the fleet
as often as the hot ones. A poll tells the router what it cannot see itself: other clients' requests on the engine.
An engine that publishes KV events shows such requests in its events (a prefill stores blocks, a decode one block
every ``block_size`` tokens), so an engine whose last poll showed nothing running or waiting, with nothing in
flight from this router or its peers and no event since the last tick, is quiet: it is polled every
``quiet_every`` ticks, and at the first tick after any of that changes. An engine without events (or a router
that does not read them) is polled every tick.

``quiet_every`` ticks stay within ``index.freshness.FreshnessPolicy.poll_stale_s`` (a quiet engine's silence
counts as idle only while its last poll is that fresh): ``quiet_ticks`` sizes it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from index.freshness import FreshnessPolicy

QUIET_TICKS = 4
QUIET_MAX_S = 0.8 * FreshnessPolicy().poll_stale_s
"""Longest gap between two polls of a quiet engine (4 s): a fifth under the freshness policy's ``poll_stale_s``, so a
poll that takes a while still lands before the engine's silence stops counting as idle."""


def quiet_ticks(interval_s: float) -> int:
    """Ticks of ``interval_s`` between polls of a quiet engine: ``QUIET_TICKS``, fewer where that would leave a
    gap over ``QUIET_MAX_S``, at least one (every tick)."""
    if not interval_s > 0:
        return 1
    return max(1, min(QUIET_TICKS, math.floor(QUIET_MAX_S / interval_s + 1e-9)))


class QuietPolls:
    """Sans-IO: ``due`` at each tick says whether to poll; ``polled`` takes what an answered poll showed."""

    def __init__(self, quiet_every: int) -> None:
        self.quiet_every = max(1, quiet_every)
        self._busy = True
        """What the last answered poll showed (running or waiting); also true from a poll taken until it is
        answered, so a poll that fails is taken again at the next tick."""
        self._skipped = 0
        self._mark: Hashable = None

    def due(self, active: bool, mark: Hashable) -> bool:
        """Whether this tick polls. ``active``: this router or a peer has requests on the engine, or the router
        cannot see others' (no events, unhealthy, draining). ``mark`` changes whenever the engine's events do (a
        change since the last tick counts as activity)."""
        moved, self._mark = mark != self._mark, mark
        if active or moved or self._busy or self._skipped + 1 >= self.quiet_every:
            self._skipped = 0
            self._busy = True
            return True
        self._skipped += 1
        return False

    def polled(self, busy: bool) -> None:
        """An answered poll: whether it showed requests running or waiting."""
        self._busy = busy
