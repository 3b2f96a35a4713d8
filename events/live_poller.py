"""One task that drains every busy engine's SUB socket on a tick shared by the process.

Each subscriber draining its own socket when its edge woke it had three faults: the loop woke once per
message (7,241 waits for I/O for 7,200 messages of 16 engines, counted by a trio instrument); subscribers
that slept out the same budget wait then each ran a slice, so together they took a whole core under a
budget of 0.3; and which engine went next was the scheduler's order, not the budget's. So a subscriber
drains the message that woke it, then hands its socket to this poller, which checks every handed-over
socket once per tick in one task (one ``zmq_poll`` over them all) and drains the readable ones a
budget slice each in turn; a socket quiet for ``quiet_ticks`` ticks goes back to its subscriber, which
waits on its FD again. The same messages then took 1,661 waits. The CPU per block op did not measurably
change on this machine (6.4-7.4 us against 6.8-8.3, three alternating pairs at 1,000 messages a second):
the loop's wake-ups were not where that time goes. The index is up to one tick later.

A check that finds no message waiting, and a drain that leaves none, do not lead to another check a tick later:
the poller sleeps on one epoll set holding the handed-over sockets' ZeroMQ FDs (edge-triggered: they signal when
a socket may have become readable) until one signals, a socket is handed over, the quietest socket is due back or
``idle_ticks`` ticks have passed, and checks then, or a tick after its last check if that is later: at most one
check a tick. While drains come a tick apart the poller ticks without the epoll wait, so busy engines are still
drained a tick's messages at a time, with one wake-up a tick. One engine streaming one answer sends
a batch every 16 tokens: on ticks at fixed instants each batch cost three wake-ups of the loop (its signal, the
tick that drained it, the empty tick after), now one. A wake-up of an idle process is dear on a virtual machine (a
bare trio sleep of 4 ms cost 223 us of CPU on the machine the README measures on). Without epoll the poller checks
once a tick.

While draining takes a large share of each tick (a fleet's worth of events), the tick doubles, up to
``max_tick_s`` (``next_tick_s``); it halves back as drains shorten, and a tick that finds nothing returns it to
``tick_s`` at once.
"""

from __future__ import annotations

import contextlib
import math
import select
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
import zmq

from events.feed import EngineFeed
from events.ingest_budget import IngestBudget
from events.socket_drain import Drained, drain_slice, wait_for_budget

Handler = Callable[[list[bytes]], object]
STRETCH_SHARE = 0.25
"""A drain that took at least this share of the tick doubles the tick (up to ``max_tick_s``) ..."""
SHRINK_SHARE = 0.1
"""... and one under this share halves it (down to ``tick_s``)."""


def next_tick_s(tick_s: float, drained_s: float, base_s: float, most_s: float) -> float:
    """The tick after a drain of ``drained_s`` on a tick of ``tick_s``. A wake-up costs the loop the same however
    few messages it finds (a bare trio sleep's wake-up cost 250-380 us of CPU on the machine the README measures
    on), so while ingest takes a large share of the loop its ticks stretch: at 150k block ops/s, 20-ms ticks cost
    5.55 us of CPU per op against 5.76-5.94 with 5-ms ones, the index 17 against 11.7-13.3 ms later at the median. A
    light stream's drains are short, so its ticks stay at the base and the index as fresh as before."""
    if drained_s >= STRETCH_SHARE * tick_s:
        return min(most_s, 2 * tick_s)
    if drained_s < SHRINK_SHARE * tick_s:
        return max(base_s, tick_s / 2)
    return tick_s


async def go_ahead() -> None:
    """Nothing to let pass before ingesting."""


@dataclass(eq=False, slots=True)
class _Handed:
    sock: zmq.Socket
    handle: Handler
    feed: EngineFeed
    clock: Callable[[], float]
    before_ingest: Callable[[], Awaitable[None]]
    last_seen: float
    """When a message last waited on the socket at a tick (at first, when it was handed over)."""
    returned: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None
    fd: int | None = None
    """Its ZeroMQ FD while it is in the poller's epoll set."""


class LivePoller:
    """Owned by the process's ingest (or by one subscriber, for a subscriber run alone); :meth:`run` is its
    task, :meth:`hand_over` what a subscriber awaits while its socket is busy."""

    def __init__(self, budget: IngestBudget, tick_s: float = 0.005, quiet_ticks: int = 20,
                 room: Callable[[EngineFeed], Awaitable[None]] | None = None, idle_ticks: int = 10,
                 max_tick_s: float | None = None) -> None:
        if tick_s <= 0 or quiet_ticks < 1 or idle_ticks < 1 or (max_tick_s is not None and max_tick_s < tick_s):
            raise ValueError("live poller: positive tick, at least one quiet and one idle tick, a longest tick no "
                             "shorter than the tick")
        self.budget = budget
        self.room = room
        """Awaited with the feed before each slice of its socket: makes room in the index ahead of the slice's
        stores (events/index_room.py)."""
        self.tick_s = tick_s
        self.max_tick_s = 4 * tick_s if max_tick_s is None else max_tick_s
        """The longest a tick stretches while draining takes a large share of it (``next_tick_s``)."""
        self.tick_now = tick_s
        """The current tick: ``tick_s``, or longer while ingest is heavy."""
        self.quiet_ticks = quiet_ticks
        self.idle_ticks = idle_ticks
        """Ticks a poller that found nothing waits at most before checking every socket again (one closed under
        it, which leaves the epoll set without a signal, is found then)."""
        self._handed: list[_Handed] = []
        self._arrived = trio.Event()
        self._watch: select.epoll | None = None
        """The handed-over sockets' FDs, while :meth:`run` runs (and the platform has epoll)."""
        self._idle: trio.CancelScope | None = None
        """The wait of a tick that found nothing: a socket handed over ends it."""

    def handed(self) -> int:
        """Sockets the poller drains now."""
        return len(self._handed)

    async def hand_over(self, sock: zmq.Socket, handle: Handler, feed: EngineFeed, clock: Callable[[], float],
                        before_ingest: Callable[[], Awaitable[None]]) -> None:
        """Let the poller drain ``sock`` into ``handle`` until it stays quiet; raises what draining it raised,
        so the subscriber's own error handling (reconnect, restart) sees it. Cancelling this takes the socket
        back at once."""
        handed = _Handed(sock, handle, feed, clock, before_ingest, trio.current_time())
        self._handed.append(handed)
        self._watch_fd(handed)
        self._arrived.set()
        if self._idle is not None:
            self._idle.cancel()
        try:
            await handed.returned.wait()
        finally:
            self._drop(handed)
        if handed.error is not None:
            raise handed.error

    def _drop(self, handed: _Handed) -> None:
        if handed in self._handed:
            self._handed.remove(handed)
        self._unwatch_fd(handed)
        handed.returned.set()

    def _watch_fd(self, handed: _Handed) -> None:
        if self._watch is None or handed.fd is not None or handed.sock.closed:
            return
        with contextlib.suppress(OSError, zmq.ZMQError):
            fd = handed.sock.getsockopt(zmq.FD)
            self._watch.register(fd, select.EPOLLIN | select.EPOLLET)
            handed.fd = fd

    def _unwatch_fd(self, handed: _Handed) -> None:
        fd, handed.fd = handed.fd, None
        if self._watch is not None and fd is not None:
            with contextlib.suppress(OSError):  # a socket closed meanwhile left the set with its FD
                self._watch.unregister(fd)

    async def run(self) -> None:
        """Poll the handed-over sockets on the ticks at which any has a message; never raises for one socket."""
        watch = select.epoll() if hasattr(select, "epoll") else None
        self._watch = watch
        try:
            for handed in self._handed:
                self._watch_fd(handed)
            await self._run()
        finally:
            for handed in self._handed:
                handed.fd = None
            self._watch = None
            if watch is not None:
                trio.lowlevel.notify_closing(watch.fileno())
                watch.close()

    async def _run(self) -> None:
        checked = passed = -math.inf
        while True:
            if not self._handed:
                await self._arrived.wait()
                self._arrived = trio.Event()
                continue
            if trio.current_time() < checked + self.tick_now:  # at most one check a tick
                await trio.sleep_until(checked + self.tick_now)
            checked = trio.current_time()
            self._forget_signals()
            ready = self._ready_at_tick()
            if not ready:
                self.tick_now = self.tick_s  # after a quiet tick, the next message is drained a base tick later
            else:
                with trio.move_on_after(self.tick_s):  # first tokens may go first, for one tick at most
                    for handed in ready:
                        try:
                            await handed.before_ingest()
                        except Exception as exc:  # noqa: BLE001 - the subscriber that handed it over restarts
                            self._fail(handed, exc)
                began = trio.current_time()
                await self._drain(ready)
                self.tick_now = next_tick_s(self.tick_now, trio.current_time() - began, self.tick_s, self.max_tick_s)
                busy, passed = checked - passed < 2 * self.tick_now, checked
                if busy:  # messages come faster than ticks: the next tick will find more
                    continue
                self._forget_signals()  # what came during the drain is checked now; later, it signals
                if any(self._waiting(list(self._handed))):
                    continue
            await self._until_a_message()

    async def _drain(self, ready: list[_Handed]) -> None:
        """Drain the ready sockets a slice each in turn, so one engine's backlog cannot starve the others
        (past their high-water marks that would be gaps), until every one was read empty (what arrives after,
        :meth:`_run` checks for)."""
        yielded = trio.current_time()
        while ready:
            more = []
            for handed in ready:
                await wait_for_budget(self.budget, ((h.feed, h.clock) for h in ready if h in self._handed))
                if self.room is not None:
                    await self.room(handed.feed)
                if handed not in self._handed:  # its subscriber took it back meanwhile
                    continue
                try:
                    if drain_slice(handed.sock, self.budget, handed.handle, handed.feed) is not Drained.EMPTY:
                        more.append(handed)
                except Exception as exc:  # the subscriber owns this socket's failures: it reconnects or restarts
                    self._fail(handed, exc)
                if trio.current_time() - yielded >= self.budget.slice_s:
                    await trio.lowlevel.checkpoint()
                    yielded = trio.current_time()
            ready = [h for h in more if h in self._handed]

    def _ready_at_tick(self) -> list[_Handed]:
        """The handed-over sockets with a message waiting; a socket quiet for ``quiet_ticks`` ticks goes back to its
        subscriber."""
        handed = list(self._handed)
        now = trio.current_time()
        ready = []
        for h, waiting in zip(handed, self._waiting(handed), strict=True):
            if waiting:
                h.last_seen = now
                ready.append(h)
            elif now - h.last_seen >= self.quiet_s:
                self._drop(h)
        return ready

    @property
    def quiet_s(self) -> float:
        return self.quiet_ticks * self.tick_s

    def _forget_signals(self) -> None:
        """Empty the epoll set's ready list before a tick checks every socket: what a signal announced so far,
        the check sees; a signal after it ends the wait that follows a tick that found nothing."""
        if self._watch is not None:
            with contextlib.suppress(OSError):
                self._watch.poll(0)

    async def _until_a_message(self) -> None:
        """After a tick that found nothing: wait until a socket signals, one is handed over, the quietest is due
        back or ``idle_ticks`` ticks pass; the next tick then checks them. Without epoll, until the next tick."""
        watch = self._watch
        if watch is None or not self._handed or any(h.fd is None for h in self._handed):
            return
        now = trio.current_time()
        due = min(min(h.last_seen for h in self._handed) + self.quiet_s, now + self.idle_ticks * self.tick_s)
        with trio.CancelScope(deadline=due) as self._idle:
            await trio.lowlevel.wait_readable(watch.fileno())
        self._idle = None

    def _waiting(self, handed: list[_Handed]) -> list[bool]:
        """Whether a message waits on each of ``handed``, by one ``zmq_poll`` over them all (a ``getsockopt(EVENTS)``
        per socket from Python cost 65 us a tick at 16 engines, the poll 15 us: at 200 ticks a second, a percent of a
        core while any engine is busy). With a socket closed under the poller (which ``zmq_poll`` would take for
        file descriptor 0) or a poll that fails, each socket is asked alone, so only the failed one's subscriber
        hears of it."""
        if not any(h.sock.closed for h in handed):
            with contextlib.suppress(zmq.ZMQError):
                polled = zmq.zmq_poll([(h.sock, zmq.POLLIN) for h in handed], 0)
                waiting = {id(sock) for sock, events in polled if events & zmq.POLLIN}
                return [id(h.sock) in waiting for h in handed]
        return [self._has_message(h) for h in handed]

    def _has_message(self, handed: _Handed) -> bool:
        try:
            return bool(handed.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError as exc:
            self._fail(handed, exc)
            return False

    def _fail(self, handed: _Handed, exc: BaseException) -> None:
        handed.error = exc
        self._drop(handed)
