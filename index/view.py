"""CacheView: the one object the gateway asks, once per request, what each engine has cached.

It combines the exact index (fed by KV events), approximate and speculative entries (what the
router dispatched) and per-engine freshness. The caller hashes the prompt once per distinct block
size among the candidates (`index.block_hash.chain`) and passes the chains keyed by block size.

A data-parallel engine's ranks keep their blocks under holder keys of their own (index/holders.py); the
engine holds a block when any rank does; everything here answers per engine, over its holders.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from index.approximate import ApproximateIndex
from index.freshness import EngineFreshness, FreshnessPolicy
from index.ingest import IngestStats
from index.store import BlockStore
from index.tiers import TierRun, clear_source, tier_holders, tier_runs

OVERFLOW_MARGIN = 1.25


@dataclass(frozen=True, slots=True)
class CacheOverlap:
    """`exact_blocks` from events (scale by `confidence`); `approx_blocks` >= exact adds guesses."""

    exact_blocks: int
    approx_blocks: int
    confidence: float
    block_size: int
    tiers: tuple[TierRun, ...] = ()
    """Blocks right after the GPU prefix that the engine's offloaded tiers hold (index/tiers.py)."""


@dataclass(slots=True)
class EngineCacheInfo:
    block_size: int
    has_events: bool
    freshness: EngineFreshness
    capacity_blocks: int | None = None
    """The engine's own reported cache size in blocks (None until its /metrics said)."""

    def block_limit(self) -> int | None:
        """The most blocks the index keeps for this engine: its capacity with a margin for events in flight
        (None: unbounded until the capacity is known)."""
        return None if self.capacity_blocks is None else int(self.capacity_blocks * OVERFLOW_MARGIN) + 1024


class CacheView:
    def __init__(self, store: BlockStore, *, speculative_ttl_s: float = 5.0,
                 approximate_ttl_s: float = 600.0, policy: FreshnessPolicy | None = None) -> None:
        self.store = store
        self.approximate = ApproximateIndex()
        self.speculative_ttl_s = speculative_ttl_s
        self.approximate_ttl_s = approximate_ttl_s
        self._policy = policy
        self._engines: dict[str, EngineCacheInfo] = {}
        self._holders: dict[str, tuple[str, ...]] = {}

    def register(self, engine: str, *, block_size: int, has_events: bool,
                 capacity_blocks: int | None = None) -> EngineCacheInfo:
        """Add or update an engine; block size and capacity come from config or its /metrics."""
        info = self._engines.get(engine)
        if info is None or info.has_events != has_events:
            info = EngineCacheInfo(block_size, has_events, EngineFreshness(has_events, self._policy))
            self._engines[engine] = info
        info.block_size = block_size
        if capacity_blocks is not None:
            info.capacity_blocks = capacity_blocks
            self.approximate.set_capacity(engine, capacity_blocks)
        return info

    def unregister(self, engine: str) -> None:
        self._engines.pop(engine, None)
        self.approximate.clear(engine)
        for holder in self._holders.pop(engine, (engine,)):
            clear_source(self.store, holder)

    def set_holders(self, engine: str, holders: Sequence[str]) -> None:
        """The engine's event sources are (again) these; blocks of holders it no longer has are dropped."""
        for gone in set(self.holders(engine)) - set(holders):
            clear_source(self.store, gone)
        self._holders[engine] = tuple(holders)

    def holders(self, engine: str) -> tuple[str, ...]:
        return self._holders.get(engine, (engine,))

    def held_by_source(self, engine: str, chains_by_block_size: Mapping[int, Sequence[int]]) -> tuple[int, ...]:
        """Leading blocks of the chain each of the engine's event sources (its data-parallel ranks, in order)
        holds; () for an engine the view does not know."""
        info = self._engines.get(engine)
        chain = chains_by_block_size.get(info.block_size, ()) if info is not None else ()
        if not chain:
            return ()
        holders = self.holders(engine)
        exact = self.store.overlap(chain, holders)
        return tuple(exact.get(h, 0) for h in holders)

    def block_count(self, engine: str) -> int:
        """Blocks the engine's events say it holds, every rank counted."""
        return sum(self.store.block_count(holder) for holder in self.holders(engine))

    def export(self, engine: str) -> tuple[np.ndarray, np.ndarray]:
        """(engine hashes, own keys) of every rank of the engine, as u64 arrays."""
        parts = [self.store.export(holder) for holder in self.holders(engine)]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def info(self, engine: str) -> EngineCacheInfo | None:
        return self._engines.get(engine)

    def block_sizes(self, engines: Iterable[str]) -> set[int]:
        """Which chains the caller must compute for these candidates."""
        return {info.block_size for e in engines if (info := self._engines.get(e)) is not None}

    def overlaps(self, chains_by_block_size: Mapping[int, Sequence[int]], engines: Iterable[str],
                 now: float) -> dict[str, CacheOverlap]:
        known = [e for e in engines if e in self._engines]
        by_size: dict[int, list[str]] = {}
        for engine in known:
            by_size.setdefault(self._engines[engine].block_size, []).append(engine)
        result: dict[str, CacheOverlap] = {}
        for size, group in by_size.items():
            chain = chains_by_block_size.get(size, ())
            exact = self.store.overlap(chain, [h for e in group for h in self.holders(e)]) if chain else {}
            for engine in group:
                info = self._engines[engine]
                held = max((exact.get(h, 0) for h in self.holders(engine)), default=0)
                approx = self.approximate.leading(engine, chain, now, start=held)
                tiers = tier_holders(self.store, self.holders(engine)) if chain else ()
                runs = tier_runs(self.store, chain, held, tiers) if tiers else ()
                result[engine] = CacheOverlap(held, approx, info.freshness.confidence(now), size, runs)
        return result

    def held_blocks(self, engine: str) -> tuple[int | None, int]:
        """(blocks the engine holds as its events say, or as the router's record says when it has no events;
        blocks the router's record alone says): None for an engine not registered."""
        info = self._engines.get(engine)
        recorded = self.approximate.size(engine)
        if info is None:
            return None, recorded
        return (self.block_count(engine) if info.has_events else recorded), recorded

    def record_dispatch(self, engine: str, chains_by_block_size: Mapping[int, Sequence[int]],
                        now: float) -> tuple[Sequence[int], float]:
        """The router sent a prompt to `engine`: remember its blocks until events (or TTL) say more.
        Returns the blocks and their TTL, for a mesh to share."""
        info = self._engines.get(engine)
        if info is None:
            return (), 0.0
        chain = chains_by_block_size.get(info.block_size)
        if not chain:
            return (), 0.0
        ttl = self.speculative_ttl_s if info.has_events else self.approximate_ttl_s
        self.approximate.record(engine, chain, now, ttl)
        return chain, ttl

    def record_remote_dispatch(self, engine: str, own_keys: Sequence[int], now: float, remaining_s: float) -> None:
        """Another replica sent these blocks to `engine` (shared through the mesh)."""
        if remaining_s > 0 and engine in self._engines:
            self.approximate.record(engine, own_keys, now, remaining_s)

    def on_ingest(self, engine: str, stats: IngestStats) -> None:
        """Real events arrived: speculative entries for those blocks are no longer needed."""
        if stats.stored_keys:
            self.approximate.discard(engine, stats.stored_keys)
        if stats.cleared:
            self.approximate.clear(engine)

    def on_reset(self, engine: str) -> None:
        """The engine restarted or cleared its cache: nothing it held is still there."""
        self.approximate.clear(engine)
