"""Event ingest with the subscribers in a child process (gateway/ingest_worker.py): the replica's second core.

With ``ingest_process = true`` the serving loop no longer receives, decodes, orders or hashes any KV event: it
applies the worker's notes (events/worker_notes.py) to its index, one message per worker tick, in slices of
the same ingest budget (events/ingest_budget.py) that holds ingest on the loop below what requests need. What
the loop still pays per block op is the index update itself.

Everything else is ``EventIngest``'s: the streams it is told to add and remove, the warm start from a peer's
snapshot (loaded into this process's index, and handed to the worker with the engine), the snapshots it
serves its peers (this process's index and the seqs whose notes it applied). The worker is supervised: when
it ends or sends what does not decode, it is counted, logged once per episode, and started again after a
backoff, and every engine is handed to the new one with the blocks this index holds and the seq it applied,
so each stream resumes from its engine's replay buffer as after a reconnect. While the worker's notes wait for
the budget, every engine's freshness says its index lags (as with ingest on the loop).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import numpy as np
import trio
import zmq

from events.counters import INGEST_PROCESS_FAILURES
from events.ingest_budget import IngestBudget
from events.socket_drain import readable, wait_for_budget
from events.subscriber import SubscriberConfig
from events.worker_notes import Note, NotesError, apply_notes, decode_notes
from gateway.event_ingest import EngineStream, EventIngest
from gateway.ingest_worker import READY, WorkerSettings, control_endpoint, notes_endpoint, pair_socket, send
from index.freshness import EngineFreshness
from index.ingest_times import INGEST_TIMES, step_clock
from index.tiers import TIER_MEDIA, tier_holder
from index.view import CacheView
from mesh.node import MeshNode

log = logging.getLogger("kvmesh.ingest")

READY_TIMEOUT_S = 60.0
"""A fresh interpreter importing the worker's modules: 1-3 s here, far more on a loaded machine."""
BACKOFF_MAX_S = 30.0
CAPACITY_EVERY_S = 1.0


class WorkerFailed(Exception):
    """The ingest process ended, did not start, or sent what does not decode."""


@dataclass(slots=True)
class RemoteFeed:
    """One event source ingested by the worker, as ``EventIngest`` reports and snapshots it."""

    engine: str
    holder: str
    applied: dict[str, int]
    cache: CacheView

    def applied_seq(self) -> int | None:
        return self.applied.get(self.holder)

    @property
    def freshness(self) -> EngineFreshness:
        info = self.cache.info(self.engine)
        return info.freshness if info is not None else EngineFreshness()


class ProcessIngest(EventIngest):
    """``EventIngest`` whose subscribers run in the ingest process; this loop applies their notes."""

    def __init__(self, cache: CacheView, mesh: MeshNode | None = None, budget: IngestBudget | None = None,
                 subscriber: SubscriberConfig | None = None, curve_secret_file: str | None = None,
                 log_level: str = "info") -> None:
        super().__init__(cache, mesh, budget=budget, subscriber=subscriber)
        config = self.subscriber
        self.settings = WorkerSettings(
            subscriber={"rcvhwm": config.rcvhwm, "max_message_bytes": config.max_message_bytes,
                        "replay_timeout_s": config.replay_timeout_s, "tick_s": config.tick_s,
                        "quiet_ticks": config.quiet_ticks},
            curve_secret_file=curve_secret_file, log_level=log_level)
        self.applied: dict[str, int] = {}
        """Per event source, the last seq whose notes this process applied."""
        self._sources: dict[str, str] = {}
        """Event source (holder) -> its engine, for every engine handed to the worker."""
        self._control: zmq.Socket | None = None
        self._control_lock = trio.Lock()
        self.worker_pid: int | None = None

    def report(self) -> dict[str, object]:
        return {"process": True, "worker_pid": self.worker_pid, "worker_starts": self.stats["worker_starts"],
                "worker_failures": self.stats["worker_failures"]}

    async def _carry(self) -> None:
        """The worker, supervised, and the engines' capacities it bounds their blocks by."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_capacity)
            await self._supervise()

    async def _follow(self, engine: str, stream: EngineStream, holders: tuple[str, ...],
                      resume: tuple[int | None, ...]) -> None:
        """Hand the engine to the worker; until cancelled, this process applies what the worker notes of it."""
        for holder, seq in zip(holders, resume, strict=True):
            self.applied.pop(holder, None)
            if seq is not None:
                self.applied[holder] = seq
            self._sources[holder] = engine
        stream.feeds = [RemoteFeed(engine, holder, self.applied, self.cache) for holder in holders]
        try:
            await self._hand_over(engine, stream)
            await trio.sleep_forever()
        finally:
            for holder in holders:
                if self._sources.get(holder) == engine:
                    del self._sources[holder]
                    self.applied.pop(holder, None)
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await self._tell({"remove": engine})

    async def _hand_over(self, engine: str, stream: EngineStream) -> None:
        """Give the worker the engine, with the blocks of each of its sources this index already holds."""
        holders = [feed.holder for feed in stream.feeds]
        loaded, arrays = [], []
        for holder in holders:
            for key in (holder, *(tier_holder(holder, medium) for medium in TIER_MEDIA)):
                if not self.cache.store.block_count(key):
                    continue
                hashes, keys = self.cache.store.export(key)
                loaded.append(key)
                arrays += [np.ascontiguousarray(hashes, dtype="<u8").tobytes(),
                           np.ascontiguousarray(keys, dtype="<u8").tobytes()]
        info = self.cache.info(engine)
        sources = [[s.endpoint, s.replay_endpoint, s.topic, s.rank, s.curve_server_key] for s in stream.sources]
        await self._tell({"add": engine, "model": stream.model, "sources": sources, "holders": holders,
                          "resume": [self.applied.get(holder) for holder in holders],
                          "capacity": info.capacity_blocks if info is not None else None, "loaded": loaded},
                         arrays)

    async def _follow_capacity(self) -> None:
        """The worker bounds each engine's blocks by its capacity (events/feed.py), which /metrics tells this side."""
        told: dict[str, int] = {}
        while True:
            await trio.sleep(CAPACITY_EVERY_S)
            for engine in set(self._sources.values()):
                info = self.cache.info(engine)
                if info is not None and info.capacity_blocks is not None and told.get(engine) != info.capacity_blocks:
                    told[engine] = info.capacity_blocks
                    await self._tell({"capacity": engine, "blocks": info.capacity_blocks})

    async def _tell(self, message: dict[str, Any], arrays: list[bytes] | None = None) -> None:
        """A control message for the worker running now; none runs: the next one is told everything at start."""
        async with self._control_lock:
            if self._control is not None:
                await send(self._control, [msgpack.packb(message, use_bin_type=True), *(arrays or [])])

    async def _supervise(self) -> None:
        failures = 0
        while True:
            began = trio.current_time()
            try:
                await self._run_worker()
            except* (WorkerFailed, zmq.ZMQError, OSError) as group:
                self.stats["worker_failures"] += 1
                INGEST_PROCESS_FAILURES.inc()
                if not failures:
                    log.error("ingest process failed; restarting it", extra={"reason": str(group.exceptions[0])})
            if trio.current_time() - began > BACKOFF_MAX_S:
                failures = 0
            failures += 1
            for engine in set(self._sources.values()):
                info = self.cache.info(engine)
                if info is not None:
                    info.freshness.on_lost(trio.current_time(), 1)
            await trio.sleep(min(BACKOFF_MAX_S, 0.25 * 2 ** min(failures, 10)))

    async def _run_worker(self) -> None:
        context = zmq.Context.instance()
        with tempfile.TemporaryDirectory(prefix="kvmesh-ingest-") as folder:
            os.chmod(folder, 0o700)
            control, notes = pair_socket(context), pair_socket(context)
            try:
                control.bind(control_endpoint(folder))
                notes.bind(notes_endpoint(folder))
                process = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "gateway.ingest_worker", folder, str(os.getpid()),
                     json.dumps(asdict(self.settings))])
                self.worker_pid = process.pid
                self.stats["worker_starts"] += 1
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_watch, process)
                        await self._until_ready(notes)
                        async with self._control_lock:
                            self._control = control
                        for engine, stream in list(self._streams.items()):
                            if stream.feeds:
                                await self._hand_over(engine, stream)
                        await self._apply(notes)
                finally:
                    self._control = None
                    self.worker_pid = None
                    process.kill()
                    with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                        await process.wait()
            finally:
                control.close(linger=0)
                notes.close(linger=0)

    async def _until_ready(self, notes: zmq.Socket) -> None:
        with trio.move_on_after(READY_TIMEOUT_S) as waited:
            await readable(notes)
            if notes.recv_multipart(zmq.NOBLOCK) != [READY]:
                raise WorkerFailed("the ingest process's first message was not its greeting")
        if waited.cancelled_caught:
            raise WorkerFailed(f"the ingest process was not ready within {READY_TIMEOUT_S:.0f} s")

    async def _apply(self, notes: zmq.Socket) -> None:
        """Apply the worker's messages in budgeted slices for as long as it runs."""
        budget = self.budget
        while True:
            await readable(notes)
            while True:
                await wait_for_budget(budget, ((feed, trio.current_time) for feed in self._feeds()))
                if self.room is not None:
                    await self.room.make()
                try:
                    frames = notes.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    for feed in self._feeds():
                        feed.freshness.on_caught_up()
                    break
                decoding = step_clock()
                try:
                    decoded = decode_notes(frames)
                except NotesError as exc:
                    raise WorkerFailed(f"notes: {exc}") from None
                finally:
                    INGEST_TIMES.decode_s += step_clock() - decoding
                await self._let_first_tokens_pass(decoded)
                began, applying = trio.current_time(), step_clock()
                apply_notes(decoded, self.cache, self._sources.__contains__, self.applied, began)
                INGEST_TIMES.applied_s += step_clock() - applying
                budget.charge(trio.current_time(), trio.current_time() - began)
                await trio.lowlevel.checkpoint()

    async def _let_first_tokens_pass(self, notes: list[Note]) -> None:
        for engine in {note.name for note in notes if note.kind == "e"}:
            stream = self._streams.get(engine)
            if stream is not None:
                await stream.before_ingest()

    def _feeds(self) -> list[RemoteFeed]:
        """Every source handed to the worker: while its notes wait, each of their indexes lags."""
        return [feed for stream in self._streams.values() for feed in stream.feeds]


async def _watch(process: trio.Process) -> None:
    code = await process.wait()
    raise WorkerFailed(f"the ingest process exited with {code}")

