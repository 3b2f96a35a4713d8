"""A replica's KV-event ingest in a process of its own: the replica's second core.

On the serving loop one replica applied 150k block ops/s in about a core of its own, with nothing left for
requests. Here a child process subscribes to every engine, decodes, orders and replays each stream and derives
the own keys against a ``KeyLedger`` (index/key_ledger.py), exactly as the serving loop would (events/feed.py,
events/subscriber.py); what the serving process must change (its index, each engine's freshness, the event
counters) goes to it as notes (events/worker_notes.py), one message per tick, over a ZMQ PAIR socket on a
private IPC path (the control messages on a second one). The serving process owns this one
(gateway/process_ingest.py): it starts it, tells it which engines to follow, and restarts it if it ends.

Control messages (serving -> worker), msgpack maps in frame 0:
    {"add": engine, "model": m, "sources": [[endpoint, replay, topic, rank, curve_server_key], ...],
     "holders": [...], "resume": [seq or nil, ...], "capacity": blocks or nil, "loaded": [holder, ...]}
        frames 1..: for each holder in "loaded", its engine hashes and own keys (u64 arrays) the serving index
        holds already (a warm start, a restarted worker)
    {"remove": engine}
    {"capacity": engine, "blocks": n}       the engine's KV capacity, which bounds its blocks (events/feed.py)
The worker's first message is ``[b"ready"]``.

Back pressure: a message waits in the socket while the serving side is behind; past the socket's high-water
mark the notes wait here, and past ``MAX_NOTED_OPS`` this process stops draining its subscribers, whose queues
then fill and drop to replays, as they would on the serving loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import trio
import zmq

from events.curve import CurveClient
from events.discovery import EventSource
from events.feed import EngineFeed
from events.ingest_budget import IngestBudget
from events.socket_drain import readable
from events.subscriber import SubscriberConfig
from events.worker_notes import CounterDeltas, NotedFreshness, NotedView, TimeDeltas, encode_notes, split_notes
from gateway.event_ingest import supervised
from gateway.logs import setup_logging
from gateway.startup_objects import freeze_startup_objects
from index.key_ledger import KeyLedger

log = logging.getLogger("kvmesh.ingest_worker")

READY = b"ready"
MAX_NOTED_OPS = 65_536
"""Block ops noted and not yet sent before ingest waits (about 1 MB of notes; 0.2-0.4 s at fleet rates)."""
MESSAGE_OPS = 2_048
"""Block ops per message at most (one note may carry more): the serving loop applies a message at once, about
1 us per op, so a backlog sent whole (65k ops) held it 70 ms and requests waited behind it."""
NOTES_HWM = 16
"""Messages queued on each side of the notes socket: with ``MAX_NOTED_OPS`` the most a lagging serving side
leaves between the processes is about 32 messages of ``MESSAGE_OPS`` plus the notes not yet sent."""
COUNTERS_EVERY_S = 1.0
NICENESS = 5
"""How much lower than its serving process the kernel ranks the ingest process when both want a core: requests
come first, and the engines' confidence falls while their index lags. At the nice level of its parent, a replica in
a 300k block ops/s overload on a machine with no core free answered chat at 3.55x its idle p99 (it waited for a
core 97% of the burst); at 5, 1.71x, and it applied 83% of the burst against 60%. At 150k ops/s with chat for a
minute it still kept up (index 63 ms behind at p99)."""
PARENT_CHECK_S = 1.0
UNKNOWN_BLOCK_SIZE = 16
"""The worker's view never hashes a prompt: an engine's block size is read from its events."""


@dataclass(slots=True)
class OutboxBudget(IngestBudget):
    """The worker's whole core goes to ingest, except while too many notes wait to be sent."""

    full: Any = None
    """Whether ingest must wait for the notes to go out."""

    def wait_s(self, now: float) -> float:
        if self.full is not None and self.full():
            return self.slice_s
        return IngestBudget.wait_s(self, now)  # slots=True makes a new class: no zero-argument super()


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What the serving process passes on the command line (JSON)."""

    subscriber: dict[str, float | int] = field(default_factory=dict)
    curve_secret_file: str | None = None
    log_level: str = "info"

    def subscriber_config(self) -> SubscriberConfig:
        curve = CurveClient.load(self.curve_secret_file) if self.curve_secret_file else None
        return SubscriberConfig(curve_client=curve, **self.subscriber)


def _source(raw: list[Any]) -> EventSource:
    endpoint, replay, topic, rank, curve_key = raw
    return EventSource(endpoint, replay, topic, rank, curve_server_key=curve_key)


class IngestWorker:
    """Every engine's subscribers, writing into one ledger whose notes go to the serving process."""

    def __init__(self, control: zmq.Socket, notes: zmq.Socket, config: SubscriberConfig) -> None:
        self.control = control
        self.out = notes
        self.config = config
        self.ledger = KeyLedger()
        self.notes = self.ledger.notes
        self.view = NotedView(self.ledger, self.notes)
        self.budget = OutboxBudget(share=1.0, idle_share=1.0, serving=lambda: False,
                                   full=lambda: self.ledger.noted_ops > MAX_NOTED_OPS)
        self.poller = config.poller(self.budget)
        self.counters = CounterDeltas()
        self.times = TimeDeltas()
        self._scopes: dict[str, trio.CancelScope] = {}

    async def run(self) -> None:
        await self._send([READY])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.poller.run)
            nursery.start_soon(self._flush)
            await self._obey(nursery)

    async def _obey(self, nursery: trio.Nursery) -> None:
        while True:
            await readable(self.control)
            while True:
                try:
                    frames = self.control.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = msgpack.unpackb(frames[0], raw=False)
                if "add" in message:
                    self._add(message, frames[1:], nursery)
                elif "remove" in message:
                    self._remove(message["remove"])
                elif "capacity" in message and message["capacity"] in self._scopes:
                    self.view.register(message["capacity"], block_size=UNKNOWN_BLOCK_SIZE, has_events=True,
                                       capacity_blocks=message["blocks"])

    def _add(self, message: dict[str, Any], arrays: list[bytes], nursery: trio.Nursery) -> None:
        engine = message["add"]
        self._remove(engine)
        self.view.register(engine, block_size=UNKNOWN_BLOCK_SIZE, has_events=True, capacity_blocks=message["capacity"])
        holders = message["holders"]
        self.view.set_holders(engine, holders)
        for at, holder in enumerate(message["loaded"]):
            hashes = np.frombuffer(arrays[2 * at], dtype="<u8").tolist()
            keys = np.frombuffer(arrays[2 * at + 1], dtype="<u8").tolist()
            self.ledger.load(holder, hashes, keys)
        scope = self._scopes[engine] = trio.CancelScope()
        nursery.start_soon(self._ingest, engine, message, scope)

    async def _ingest(self, engine: str, message: dict[str, Any], scope: trio.CancelScope) -> None:
        with scope:
            feeds = []
            for holder, seq in zip(message["holders"], message["resume"], strict=True):
                feed = EngineFeed(engine, message["model"], self.view, resume_seq=seq, holder=holder)
                feed.freshness = NotedFreshness(engine, holder, self.notes)
                feeds.append(feed)
            async with trio.open_nursery() as nursery:
                for feed, raw in zip(feeds, message["sources"], strict=True):
                    nursery.start_soon(supervised, feed, _source(raw), self.poller, self.config)

    def _remove(self, engine: str) -> None:
        scope = self._scopes.pop(engine, None)
        if scope is None:
            return
        scope.cancel()
        for holder in self.view.holders(engine):
            self.ledger.forget_source(holder)  # not noted: the serving side dropped the engine itself
        self.view.unregister(engine)

    async def _flush(self) -> None:
        """Send the notes once per tick (and the counters' and ingest times' growth once a second)."""
        counted_at = trio.current_time()
        while True:
            await trio.sleep(self.config.tick_s)
            if trio.current_time() - counted_at >= COUNTERS_EVERY_S:
                counted_at = trio.current_time()
                self.notes.extend(self.counters.notes())
                self.notes.extend(self.times.notes())
            if not self.notes:
                continue
            notes = list(self.notes)
            self.notes.clear()
            self.ledger.noted_ops = 0
            for part in split_notes(notes, MESSAGE_OPS):
                await self._send(encode_notes(part))

    async def _send(self, frames: list[bytes]) -> None:
        await send(self.out, frames)


async def send(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send once the socket takes it (its peer connected and under its high-water mark); one task per socket."""
    while not sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
        await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))
    sock.send_multipart(frames, zmq.NOBLOCK)


async def _watch_parent(parent_pid: int) -> None:
    """End with the serving process, however it ended."""
    while os.getppid() == parent_pid:
        await trio.sleep(PARENT_CHECK_S)
    raise SystemExit(0)


def pair_socket(context: zmq.Context) -> zmq.Socket:
    sock = context.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, NOTES_HWM)
    sock.setsockopt(zmq.RCVHWM, NOTES_HWM)
    return sock


async def serve(folder: str, parent_pid: int, settings: WorkerSettings) -> None:
    context = zmq.Context.instance()
    control, notes = pair_socket(context), pair_socket(context)
    control.connect(control_endpoint(folder))
    notes.connect(notes_endpoint(folder))
    worker = IngestWorker(control, notes, settings.subscriber_config())
    freeze_startup_objects()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_parent, parent_pid)
            await worker.run()
    finally:
        control.close(linger=0)
        notes.close(linger=0)


def control_endpoint(folder: str) -> str:
    return f"ipc://{folder}/control"


def notes_endpoint(folder: str) -> str:
    return f"ipc://{folder}/notes"


def main(argv: list[str]) -> int:
    folder, parent_pid, raw = argv
    settings = WorkerSettings(**json.loads(raw))
    setup_logging(settings.log_level)
    with contextlib.suppress(OSError):  # a platform without niceness runs it at its parent's
        os.nice(NICENESS)
    try:
        trio.run(serve, folder, int(parent_pid), settings)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
