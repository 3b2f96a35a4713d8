"""When in each interval an engine's periodic polls fall: at a phase of its own, not every engine at once.

Every engine's watch starts with the router, and each poll loop slept one interval from its last poll, so the
fleet's ``/metrics`` and ``/health`` polls came in bunches at the same part of every second (each costs the loop
0.4-0.7 ms of CPU, timed against a simulated engine), and a request arriving then waited behind the bunch: most of
the slow probes (over 5 ms) of an idle router in front of 16 simulated engines fell in the same third of each
second. Each engine's polls now fall at a phase derived from its id (the same in every process and run), so the
fleet's polls spread over the interval; the README's "Polls spread over the second" has the runs.
"""

from __future__ import annotations

import math
import zlib

import trio


def phase_s(engine_id: str, interval_s: float, offset: float = 0.0) -> float:
    """The engine's phase in an interval of ``interval_s``: its id's hash as a fraction of the interval, moved by
    ``offset`` of an interval (so two polls of one engine can keep apart)."""
    fraction = zlib.crc32(engine_id.encode("utf-8", "surrogatepass")) / 2**32
    return ((fraction + offset) % 1.0) * interval_s


def next_tick(now: float, tick_s: float) -> float:
    """The first multiple of ``tick_s`` after ``now`` (strictly: at a multiple itself, ``now / tick_s`` may round below
    its count, and a deadline of ``now`` would let a loop run again without time passing, for ever under a clock
    that only moves while every task waits)."""
    count = math.floor(now / tick_s) + 1
    while count * tick_s <= now:
        count += 1
    return count * tick_s


def next_poll_at(now: float, interval_s: float, phase: float) -> float:
    """The first time after ``now`` that lies ``phase`` past a multiple of ``interval_s``."""
    due = next_tick(now - phase, interval_s) + phase
    while due <= now:  # the subtraction and addition may round back onto ``now``
        due += interval_s
    return due


async def sleep_until_phase(interval_s: float, phase: float) -> None:
    """Sleep until the next time ``phase`` past a multiple of ``interval_s`` (``next_poll_at`` from trio's clock)."""
    await trio.sleep_until(next_poll_at(trio.current_time(), interval_s, phase))
