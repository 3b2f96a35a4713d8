"""One watch for every engine read of a trio run that must end when the engine stalls.

A streamed answer is one read from the engine per token, and each read needs an idle timeout. As a cancel
scope per read it cost 6-10 us (entered, its deadline registered and unregistered, left) of the 21-31 us a read
cost on a socket pair, and 8% of the router's samples relaying 256-token answers to 16 streams.
Here a read registers its deadline in a set (a dict insert and delete), and one task sleeps until the
earliest one; a read still waiting then is woken with trio's ``notify_closing`` on its socket, so it raises
``ClosedResourceError`` with ``Wait.stalled`` set, and its connection is closed, never reused.

The watch is a trio system task, started by the first read of a run and ended with it: every ``EnginePool``
of the run (the router's, a bench's, a test's) shares it without a nursery of its own. A system task's
exception would crash the run, so everything it does is caught, logged once and counted.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import trio
from prometheus_client import Counter

log = logging.getLogger("kvmesh.upstream")
STALL_WATCH = Counter("kvmesh_upstream_stall_watch_total",
                      "Engine reads the stall watch ended (no byte within the idle timeout: stalled) and wake-ups of "
                      "such reads that raised (wake_failed)", ["outcome"])
_WATCH: trio.lowlevel.RunVar[StallWatch] = trio.lowlevel.RunVar("kvmesh_stall_watch")


@dataclass(eq=False, slots=True)
class Wait:
    """One read waiting on ``fd`` until trio time ``until``."""

    fd: int
    until: float
    stalled: bool = False
    """Set by the watch as it wakes the read: the engine sent nothing in time."""


class StallWatch:
    """The waiting reads of one trio run, and the task that ends those past their deadline."""

    def __init__(self) -> None:
        self.waits: set[Wait] = set()
        self._logged = False
        """A wake-up raised (a socket already closed under its read, say): logged once, every one counted."""
        self._sleep: trio.CancelScope | None = None

    def begin(self, fd: int, until: float) -> Wait:
        """Register a read of ``fd`` that must end by ``until``; ``end`` it whatever happens."""
        wait = Wait(fd, until)
        self.waits.add(wait)
        sleep = self._sleep
        if sleep is not None and until < sleep.deadline:
            sleep.deadline = until
        return wait

    def end(self, wait: Wait) -> None:
        self.waits.discard(wait)

    def expire(self, now: float) -> None:
        """Wake every read past its deadline (sans waiting: the task's loop calls it)."""
        for wait in [w for w in self.waits if w.until <= now]:
            self.waits.discard(wait)
            wait.stalled = True
            try:
                trio.lowlevel.notify_closing(wait.fd)
                STALL_WATCH.labels(outcome="stalled").inc()
            except Exception:  # a read whose socket went away meanwhile has nothing left to wake
                STALL_WATCH.labels(outcome="wake_failed").inc()
                if not self._logged:
                    self._logged = True
                    log.exception("could not wake a stalled engine read")

    def next_deadline(self) -> float:
        return min((w.until for w in self.waits), default=math.inf)

    async def run(self) -> None:
        """Sleep until the earliest deadline (a read with an earlier one moves it), then expire."""
        while True:
            with trio.CancelScope(deadline=self.next_deadline()) as self._sleep:
                await trio.sleep_forever()
            self._sleep = None
            self.expire(trio.current_time())


def stall_watch() -> StallWatch:
    """The run's watch, its task started on first use."""
    try:
        return _WATCH.get()
    except LookupError:
        watch = StallWatch()
        _WATCH.set(watch)
        trio.lowlevel.spawn_system_task(watch.run, name="kvmesh engine stall watch")
        return watch
