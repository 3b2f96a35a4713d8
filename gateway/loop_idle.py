"""How long the trio loop waits with no task ready: the idle time the ingest budget gives to KV events.

Trio calls an instrument's ``before_io_wait`` and ``after_io_wait`` once per pass of its scheduler, around the
poll for I/O. A poll with a zero timeout (tasks were ready) is not idle; one that may block is, for as long as
it blocks. The running total is read with each loop-lag reading (gateway/replica.py); the budget turns its
differences into serving's share of the loop (events/ingest_budget.py).
"""

from __future__ import annotations

import trio


class LoopIdle(trio.abc.Instrument):
    """A running total of the loop's blocking I/O waits, in seconds of trio's clock."""

    def __init__(self) -> None:
        self.idle_s = 0.0
        self._began: float | None = None

    def before_io_wait(self, timeout: float) -> None:
        self._began = trio.current_time() if timeout > 0 else None

    def after_io_wait(self, timeout: float) -> None:
        if self._began is not None:
            self.idle_s += trio.current_time() - self._began
            self._began = None
