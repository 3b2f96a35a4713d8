"""Every engine's KV-event streams, ingested by this replica itself, warmed from a peer when it starts.

Each replica subscribes to every engine's publisher and keeps its own exact index: the cost per block
op is the same whatever the number of replicas (ZMQ PUB fans out to every subscriber), and no block
op crosses the mesh. Replicating every block through the CRDT document instead cost ~60 us of CPU and
~1.3 KB per block on every replica, and collapsed two replicas at ~16k block ops/s.

A replica that starts, or learns a new engine, first asks its peers for their index of that engine
(gateway/index_transfer.py) and resumes each event source from the seq the best answer had reached; the
engine's replay buffer fills the rest. Without an answer (alone, or peers as new as itself) it backfills
from the replay buffer alone.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from events.counters import SUBSCRIBER_RESTARTS
from events.discovery import EventSource
from events.feed import EngineFeed
from events.index_room import IndexRoom
from events.ingest_budget import IngestBudget
from events.live_poller import LivePoller
from events.subscriber import SubscriberConfig, go_ahead, run_subscriber
from gateway import index_transfer
from index.holders import holder_keys
from index.prefix_index import PrefixIndex
from index.view import CacheView
from mesh.node import MeshNode

log = logging.getLogger("kvmesh.ingest")

WARM_TIMEOUT_S = 2.0
MAX_WARM_BLOCKS = 4_000_000
"""Bound on a peer's snapshot of an engine whose capacity (num_gpu_blocks) is not known yet: several times
the blocks of the largest GPU's KV cache at vLLM's smallest block size."""
SUBSCRIBER_BACKOFF_MAX_S = 30.0
LOAD_SLICE = 20_000
"""Blocks loaded from a peer's snapshot between two yields to the scheduler."""


@dataclass
class EngineStream:
    model: str
    sources: list[EventSource]
    before_ingest: Callable[[], Awaitable[None]] = go_ahead
    capacity_blocks: Callable[[], int | None] = lambda: None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    feeds: list[EngineFeed] = field(default_factory=list)


async def supervised(feed: EngineFeed, source: EventSource, poller: LivePoller | None = None,
                      config: SubscriberConfig | None = None,
                      before_ingest: Callable[[], Awaitable[None]] = go_ahead) -> None:
    """Run the subscriber; an error no one expected (a publisher's frames reaching a bug) is counted, logged
    once per episode, marks the engine's knowledge partly lost and restarts it after a backoff: one
    engine's stream never ends the router."""
    failures = 0
    while True:
        try:
            await run_subscriber(feed, source, poller=poller, config=config, before_ingest=before_ingest)
            return
        except Exception as exc:  # the publisher is untrusted: nothing it sends may end the process
            SUBSCRIBER_RESTARTS.labels(engine=feed.engine, reason=f"error_{type(exc).__name__}"[:64]).inc()
            if not failures:
                log.error("event subscriber failed; restarting", exc_info=exc, extra={"engine": feed.engine})
            feed.freshness.on_lost(trio.current_time(), 1)
            feed.on_publisher_lost()
            failures += 1
        await trio.sleep(min(SUBSCRIBER_BACKOFF_MAX_S, 0.25 * 2 ** min(failures, 10)))


class EventIngest:
    """Supervises every engine's ingest: :meth:`add` and :meth:`remove` (callable from anywhere, they never
    await) hand the stream to :meth:`run`, whose nursery owns every subscriber task."""

    def __init__(self, cache: CacheView, mesh: MeshNode | None = None, warm_timeout_s: float = WARM_TIMEOUT_S,
                 budget: IngestBudget | None = None, subscriber: SubscriberConfig | None = None) -> None:
        self.cache = cache
        self.subscriber = subscriber or SubscriberConfig()
        self.mesh = mesh
        self.budget = budget or IngestBudget()
        """The share of the event loop every engine's ingest together may take (events/ingest_budget.py)."""
        self.room = IndexRoom(cache.store) if isinstance(cache.store, PrefixIndex) else None
        """Grows and sweeps the index's tables ahead of ingest, off the loop (events/index_room.py)."""
        self.poller = self.subscriber.poller(self.budget, self.room.make if self.room else None)
        """Drains every publishing engine's socket once per tick (events/live_poller.py); run by :meth:`run`."""
        self.warm_timeout_s = warm_timeout_s
        self.stats: Counter[str] = Counter()
        self._streams: dict[str, EngineStream] = {}
        self._send, self._started = trio.open_memory_channel[tuple[str, EngineStream]](math.inf)

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Own every engine's subscriber tasks; answer peers' index queries."""
        if self.mesh is not None:
            self.mesh.serve_state(index_transfer.NAMESPACE, self._snapshot)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._carry)
            task_status.started()
            async for engine, stream in self._started:
                nursery.start_soon(self._ingest, engine, stream)

    async def _carry(self) -> None:
        """What carries every engine's events while the streams run: here the live poller."""
        await self.poller.run()

    def add(self, engine: str, model: str, sources: list[EventSource],
            before_ingest: Callable[[], Awaitable[None]] = go_ahead,
            capacity_blocks: Callable[[], int | None] = lambda: None) -> None:
        """The engine's event endpoints are known: warm up from a peer (no more blocks than
        ``capacity_blocks()``, the engine's KV capacity when known), then subscribe (awaiting
        ``before_ingest`` before each pass over its queued events)."""
        self.remove(engine)
        self._streams[engine] = stream = EngineStream(model, sources, before_ingest, capacity_blocks)
        self._send.send_nowait((engine, stream))

    def remove(self, engine: str) -> None:
        stream = self._streams.pop(engine, None)
        if stream is not None:
            stream.scope.cancel()

    def feeds(self, engine: str) -> list[EngineFeed]:
        """The engine's event feeds (one per data-parallel rank) once its ingest runs; none before."""
        stream = self._streams.get(engine)
        return list(stream.feeds) if stream is not None else []

    def report(self) -> dict[str, object]:
        """Where this replica's ingest runs, for ``GET /admin/index``."""
        return {"process": False}

    def ingesting(self) -> list[str]:
        return sorted(e for e, s in self._streams.items() if s.feeds)

    async def _ingest(self, engine: str, stream: EngineStream) -> None:
        with stream.scope:
            holders = holder_keys(engine, [source.rank for source in stream.sources])
            self.cache.set_holders(engine, holders)
            resume = await self._warm(engine, holders, stream.capacity_blocks() or MAX_WARM_BLOCKS)
            log.info("ingesting events", extra={"engine": engine, "resume_seq": list(resume)})
            await self._follow(engine, stream, holders, resume)

    async def _follow(self, engine: str, stream: EngineStream, holders: tuple[str, ...],
                      resume: tuple[int | None, ...]) -> None:
        """Ingest the engine's sources (one per holder, each from its ``resume`` seq) until cancelled."""
        stream.feeds = [EngineFeed(engine, stream.model, self.cache, resume_seq=seq, holder=holder)
                        for seq, holder in zip(resume, holders, strict=True)]
        async with trio.open_nursery() as nursery:
            for feed, source in zip(stream.feeds, stream.sources, strict=True):
                nursery.start_soon(supervised, feed, source, self.poller, self.subscriber, stream.before_ingest)

    async def _warm(self, engine: str, holders: tuple[str, ...], capacity: int) -> tuple[int | None, ...]:
        """Load the freshest peer's index of ``engine`` (each source's blocks into its holder) unless it holds
        more than ``capacity`` blocks; the seqs to resume each source from. The engine's confidence stays
        reduced by the peer's lag until its own events confirm the snapshot."""
        sources = len(holders)
        cold = (None,) * sources
        if self.mesh is None:
            return cold
        answers = await self.mesh.fetch_state(index_transfer.NAMESPACE, engine, self.warm_timeout_s)
        snapshots = []
        for peer, blob in answers.items():
            if blob is None:
                continue
            try:
                snapshot = index_transfer.decode(blob, sources)
                if snapshot.blocks > capacity:
                    raise ValueError(f"{snapshot.blocks} blocks, more than the engine's {capacity}")
                snapshots.append(snapshot)
            except ValueError as exc:
                self.stats["bad_snapshot"] += 1
                log.warning("refused a peer's index snapshot", extra={"engine": engine, "peer": peer,
                                                                      "reason": str(exc)})
        best = index_transfer.best(snapshots)
        if best is None:
            self.stats["cold_starts"] += 1
            return cold
        for holder, hash_array, own_array in zip(holders, best.hashes, best.own_keys, strict=True):
            hashes, own_keys = hash_array.tolist(), own_array.tolist()
            for start in range(0, len(hashes), LOAD_SLICE):
                end = start + LOAD_SLICE
                self.cache.store.store_many(holder, hashes[start:end], own_keys[start:end])
                await trio.sleep(0)
        info = self.cache.info(engine)
        if info is not None:
            info.freshness.on_warm(best.lag_s)
        self.stats["warm_starts"] += 1
        log.info("index warmed from a peer", extra={"engine": engine, "blocks": best.blocks,
                                                    "resume_seq": list(best.seqs), "peer_lag_s": best.lag_s})
        return best.seqs

    def _snapshot(self, engine: str) -> bytes | None:
        """This replica's index of ``engine`` for a starting peer; None until its own ingest runs."""
        stream = self._streams.get(engine)
        if stream is None or not stream.feeds:
            return None
        seqs = [feed.applied_seq() for feed in stream.feeds]
        if all(seq is None for seq in seqs):
            return None
        exported = [self.cache.store.export(feed.holder) for feed in stream.feeds]
        lag = stream.feeds[0].freshness.lag(trio.current_time())
        return index_transfer.encode(seqs, [e[0] for e in exported], [e[1] for e in exported],
                                     min(lag, index_transfer.MAX_LAG_S))
