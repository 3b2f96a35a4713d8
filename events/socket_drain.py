"""Waiting for and draining a ZMQ socket on trio, with the work charged to the process's ingest budget."""

from __future__ import annotations

from collections.abc import Callable

import trio
import zmq

from events.counters import INGEST_DEFERRED
from events.feed import EngineFeed
from events.ingest_budget import IngestBudget


async def readable(sock: zmq.Socket) -> None:
    """Wait until the socket has a message; ZMQ's FD only signals edges, so re-check EVENTS."""
    while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))


async def drain(sock: zmq.Socket, budget: IngestBudget, handle: Callable[[list[bytes]], object],
                feed: EngineFeed, clock: Callable[[], float]) -> bool:
    """Handle every queued message in budgeted slices; returns True when an end marker was handled
    (``handle`` answered True), False once the socket is empty."""
    while True:
        wait = budget.wait_s(trio.current_time())
        if wait > 0:
            INGEST_DEFERRED.labels(engine=feed.engine).inc(wait)
            feed.freshness.on_deferred(clock())
            await trio.sleep(wait)
        began = trio.current_time()
        try:
            while trio.current_time() - began < budget.slice_s:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    feed.freshness.on_caught_up()
                    return False
                if handle(frames) is True:
                    return True
        finally:
            budget.charge(trio.current_time(), trio.current_time() - began)
        await trio.lowlevel.checkpoint()
