"""When in each interval an engine's periodic polls fall: at a phase of its own, not all engines at once.

Every engine's watch starts with the router, and each poll loop slept one interval from its last poll, so the
whole fleet's ``/metrics`` and ``/health`` polls fell in the same few milliseconds of every interval, each
costing the serving loop 0.4-0.7 ms of CPU (``EnginePool.get`` with its parse, timed against a simulated engine):
a request arriving then waited behind all of them, about 17 ms at 16 engines and 70 at 64, once a second. Each
engine's polls now fall at a phase derived from its id (the same in every process and run), so a fleet's polls
spread over the interval and a request meets one or two of them at most.
"""

from __future__ import annotations

import zlib

from events.live_poller import next_tick


def phase_s(engine_id: str, interval_s: float, offset: float = 0.0) -> float:
    """The engine's phase in an interval of ``interval_s``: its id's hash as a fraction of the interval, moved by
    ``offset`` of an interval (so two polls of one engine can keep apart)."""
    fraction = zlib.crc32(engine_id.encode("utf-8", "surrogatepass")) / 2**32
    return ((fraction + offset) % 1.0) * interval_s


def next_poll_at(now: float, interval_s: float, phase: float) -> float:
    """The first time after ``now`` that lies ``phase`` past a multiple of ``interval_s``."""
    due = next_tick(now - phase, interval_s) + phase
    while due <= now:  # the subtraction and addition may round back onto ``now``
        due += interval_s
    return due
