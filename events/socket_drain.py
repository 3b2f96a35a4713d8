"""Waiting for and draining a ZMQ socket on trio, with the work charged to the process's ingest budget."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable

import trio
import zmq

from events.counters import INGEST_DEFERRED
from events.feed import EngineFeed
from events.ingest_budget import IngestBudget
from index.ingest_times import step_clock


class Drained(enum.Enum):
    EMPTY = "empty"
    """Every queued message was handled."""
    MARKER = "marker"
    """``handle`` answered True (a replay's end)."""
    MORE = "more"
    """The slice's time ran out with messages left."""


async def readable(sock: zmq.Socket) -> None:
    """Wait until the socket has a message; ZMQ's FD only signals edges, so re-check EVENTS."""
    while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))


async def wait_for_budget(budget: IngestBudget, waiting: Iterable[tuple[EngineFeed, Callable[[], float]]]) -> None:
    """Sleep until the budget allows a slice; every engine in ``waiting`` (feed and its clock) has events
    queued meanwhile, so its index lags and the time waited is counted for it. The budget is asked again
    after each sleep: another consumer (a replay) may have spent what the sleep refilled."""
    wait = budget.wait_s(trio.current_time())
    if wait <= 0:
        return
    behind = list(waiting)
    for feed, clock in behind:
        feed.freshness.on_deferred(clock())
    began = trio.current_time()
    while wait > 0:
        await trio.sleep(wait)
        wait = budget.wait_s(trio.current_time())
    waited = trio.current_time() - began
    for feed, _ in behind:
        INGEST_DEFERRED.labels(engine=feed.engine).inc(waited)


def drain_slice(sock: zmq.Socket, budget: IngestBudget, handle: Callable[[list[bytes]], object],
                feed: EngineFeed) -> Drained:
    """Handle queued messages for at most one budget slice, charging the time spent (and what decoding and
    applying did not take of it to the feed's ingest times, as the rest)."""
    began = trio.current_time()
    times = feed.ingest.times
    started, in_steps = step_clock(), times.in_steps()
    try:
        while trio.current_time() - began < budget.slice_s:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                feed.freshness.on_caught_up()
                return Drained.EMPTY
            if handle(frames) is True:
                return Drained.MARKER
        return Drained.MORE
    finally:
        budget.charge(trio.current_time(), trio.current_time() - began)
        times.rest_s += max(0.0, step_clock() - started - (times.in_steps() - in_steps))


async def drain(sock: zmq.Socket, budget: IngestBudget, handle: Callable[[list[bytes]], object],
                feed: EngineFeed, clock: Callable[[], float]) -> bool:
    """Handle every queued message in budgeted slices; returns True when an end marker was handled
    (``handle`` answered True), False once the socket is empty."""
    while True:
        await wait_for_budget(budget, [(feed, clock)])
        drained = drain_slice(sock, budget, handle, feed)
        if drained is not Drained.MORE:
            return drained is Drained.MARKER
        await trio.lowlevel.checkpoint()
