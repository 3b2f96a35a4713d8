"""``kvmesh bench ingest --zmq RATE``: CPU per block op through a replica's real subscribers, over ZeroMQ.

The in-process passes of ``kvmesh bench ingest`` call the feed directly; a replica also pays for each message's
trip through its loop (waiting on the socket, the scheduler, the receive). Here the same recorded messages of the
realistic mix are published by a forked process over TCP on loopback, one PUB per engine, spread evenly in time
at RATE messages per second (engines publish independently), into ``gateway.event_ingest.EventIngest`` on one
trio loop: the replica's subscribers, live poller and ingest budget (given the idle share, as with no request in
flight). The figure is the CPU of the loop's thread (and of the whole process, with ZeroMQ's I/O thread) from the
first message until every engine's last one was applied, per block op.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.synchronize import Event as ProcessEvent

import trio
import zmq

from bench.event_mix import BLOCK_SIZE
from bench.processes import free_port_range
from bench.recorded_events import MODEL, Message, freeze, recorded_mix
from events.discovery import EventSource
from events.ingest_budget import IngestBudget
from gateway.event_ingest import EventIngest
from index.prefix_index import PrefixIndex
from index.view import CacheView

TOPIC = "kv"
SETTLE_S = 1.0
"""Time the subscribers get to connect before the first message."""
TIMEOUT_S = 300.0


def _publish(endpoints: list[str], messages: list[Message], rate: float, start: ProcessEvent,
             done: ProcessEvent) -> None:
    """The fleet's side: every message at its turn, then stay connected until the replica has them all
    (ZeroMQ drops what a subscriber has not read when its publisher goes)."""
    context = zmq.Context()
    socks = []
    for endpoint in endpoints:
        sock = context.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.bind(endpoint)
        socks.append(sock)
    start.wait(TIMEOUT_S)
    began = time.monotonic()
    for n, (i, frames) in enumerate(messages):
        delay = began + n / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        socks[i].send_multipart(frames)
    done.wait(TIMEOUT_S)
    for sock in socks:
        sock.close(linger=0)
    context.term()


def measure_over_zmq(engines: int = 16, cap: int = 20_000, steps: int = 100, rate: float = 1_000.0,
                     seed: int = 0) -> str:
    """The line this mode prints (its ``ops: N us`` figure is what ``--against`` compares)."""
    mix = recorded_mix(engines, cap, steps, seed)
    messages, ops = mix.fill + mix.steady, mix.fill_ops + mix.steady_ops
    last = {i: int.from_bytes(frames[1], "big") for i, frames in messages}
    base = free_port_range(engines)
    endpoints = [f"tcp://127.0.0.1:{base + i}" for i in range(engines)]
    fork = multiprocessing.get_context("fork")
    start, done = fork.Event(), fork.Event()
    publisher = fork.Process(target=_publish, args=(endpoints, messages, rate, start, done), daemon=True)
    publisher.start()
    try:
        loop_s, process_s, wall_s = trio.run(_subscribe, engines, endpoints, last, start)
    finally:
        done.set()
        publisher.join(10)
    us = 1e6 / ops
    return (f"over ZeroMQ, {engines} engines at {rate:,.0f} messages/s ({rate * ops / len(messages):,.0f} block "
            f"ops/s), {len(messages):,} messages, {ops:,} ops: {loop_s * us:.2f} us per op on the loop's thread "
            f"({process_s * us:.2f} for the process); all applied {wall_s:.1f} s after the first message "
            f"(publishing took {len(messages) / rate:.1f} s)")


async def _subscribe(engines: int, endpoints: list[str], last: dict[int, int],
                     start: ProcessEvent) -> tuple[float, float, float]:
    view = CacheView(PrefixIndex())
    ingest = EventIngest(view, budget=IngestBudget(serving=lambda: False))
    async with trio.open_nursery() as nursery:
        await nursery.start(ingest.run)
        for i, endpoint in enumerate(endpoints):
            view.register(f"e{i}", block_size=BLOCK_SIZE, has_events=True)
            ingest.add(f"e{i}", MODEL, [EventSource(endpoint, None, TOPIC)])
        await trio.sleep(SETTLE_S)
        freeze()  # as a replica does once built (gateway/server.py): numba's objects are not walked by gc
        loop0, process0, wall0 = time.thread_time(), time.process_time(), trio.current_time()
        start.set()
        with trio.fail_after(TIMEOUT_S):
            while not _all_applied(ingest, last):
                await trio.sleep(0.01)
        measured = (time.thread_time() - loop0, time.process_time() - process0, trio.current_time() - wall0)
        nursery.cancel_scope.cancel()
    return measured


def _all_applied(ingest: EventIngest, last: dict[int, int]) -> bool:
    for i, seq in last.items():
        feeds = ingest.feeds(f"e{i}")
        if len(feeds) != 1 or feeds[0].ingest.last_seq != seq:
            return False
    return True

