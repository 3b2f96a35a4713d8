"""Sans-IO application of decoded KV-event batches of one engine to a BlockStore.

Own keys are derived from the token ids in BlockStored (index/block_hash.py), chained onto the
parent's own key found through the engine's alias map. How vLLM fills `extra_keys` (per block,
kv_cache_utils.generate_block_hash_extra_keys): LoRA name, multimodal (identifier, offset) pairs,
the request's cache_salt (first block only), prompt-embedding digests. Recent vLLM writes the salt
and LoRA name as plain strings, the form in docs/vllm.md is ("cache_salt", salt) / ("lora", name, path);
both are read. The salt and LoRA name go into the root seed exactly as the router does it; any other
extra key is mixed into that block's key, so such blocks never match a text-only request chain.
Events from engines that do not send `extra_keys` (older vLLM) give salted blocks unsalted keys: the
router's salted chains then never match them (no false sharing across tenants, only missed reuse).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from index.block_hash import chain_from, next_key, root_seed
from index.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from index.ingest_times import INGEST_TIMES, IngestTimes, step_clock
from index.store import BlockStore
from index.tiers import TIER_MEDIA, clear_source, tier_holder

# The engine's own KV cache; offloaded tiers go to tier holders (index/tiers.py), other groups are skipped.
INDEXED_MEDIA = frozenset({None, "GPU"})
INDEXED_GROUPS = frozenset({None, 0})
_MAX_ROOTS = 1024
"""Chain seeds remembered per stream (one per tenant salt and adapter in use)."""


@dataclass(slots=True)
class IngestStats:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphaned: int = 0
    skipped: int = 0
    stored_keys: list[int] = field(default_factory=list)

    def merge(self, other: IngestStats) -> None:
        self.stored += other.stored
        self.removed += other.removed
        self.cleared += other.cleared
        self.orphaned += other.orphaned
        self.skipped += other.skipped
        self.stored_keys.extend(other.stored_keys)


@dataclass(frozen=True, slots=True)
class SplitExtra:
    lora_name: str | None
    cache_salt: str | None
    other: bytes | None


def split_extra_keys(extra: Any, lora_name: str | None, first_block: bool) -> SplitExtra:
    """Separate the request-wide keys (LoRA name, salt) from block content keys (multimodal, embeds)."""
    salt: str | None = None
    lora = lora_name
    lora_seen = False
    others: list[Any] = []
    for item in extra or ():
        if isinstance(item, tuple) and len(item) == 2 and item[0] == "cache_salt" and isinstance(item[1], str):
            salt = item[1]
        elif isinstance(item, tuple) and len(item) >= 2 and item[0] == "lora" and isinstance(item[1], str):
            lora = lora or item[1]
        elif isinstance(item, str) and not lora_seen and lora is not None and item == lora:
            lora_seen = True
        elif isinstance(item, str) and first_block and salt is None:
            salt = item
        else:
            others.append(item)
    packed = msgpack.packb(others, use_bin_type=True) if others else None
    return SplitExtra(lora_name=lora, cache_salt=salt, other=packed)


class _Run:
    """Stored blocks of one holder not yet in the store, in event order, and their aliases by engine hash."""

    __slots__ = ("holder", "hashes", "keys", "recent")

    def __init__(self) -> None:
        self.holder: str | None = None
        self.hashes: list[int] = []
        self.keys: list[int] = []
        self.recent: dict[int, int] = {}

    def add(self, hashes: Sequence[int], keys: list[int]) -> None:
        self.hashes.extend(hashes)
        self.keys.extend(keys)
        self.recent.update(zip(hashes, keys, strict=True))

    def flush(self, store: BlockStore, stats: IngestStats) -> None:
        if self.hashes:
            stats.stored += store.store_many(self.holder, self.hashes, self.keys)
            self.hashes, self.keys, self.recent = [], [], {}
        self.holder = None


class EngineIngest:
    """Applies one event stream's batches in order; the caller guarantees order (events/sequence.py).

    ``holder`` is the store key of the stream's blocks: the engine id, or one data-parallel rank's key
    (index/holders.py). Its time goes to ``times`` (the process's sums unless given)."""

    def __init__(self, holder: str, model: str, store: BlockStore, times: IngestTimes = INGEST_TIMES) -> None:
        self.holder = holder
        self.model = model
        self.store = store
        self.times = times
        self.last_seq: int | None = None
        self.block_size: int | None = None
        self._roots: dict[tuple[str | None, str | None], int] = {}

    def apply(self, batch: EventBatch) -> IngestStats:
        """Consecutive stored events of one holder enter the store as one call: a step's decode events are
        single blocks each (three in four stored events on the realistic mix), and a store call per event
        cost more than the block. Their order is kept, and a parent stored earlier in the run is found in
        the run itself."""
        began = step_clock()
        stats = IngestStats()
        run = _Run()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event, stats, run)
                continue
            run.flush(self.store, stats)
            if isinstance(event, BlockRemoved):
                if event.medium in INDEXED_MEDIA and event.group_idx in INDEXED_GROUPS:
                    stats.removed += self.store.remove(self.holder, event.block_hashes)
                elif event.medium in TIER_MEDIA and event.group_idx in INDEXED_GROUPS:
                    stats.removed += self.store.remove(tier_holder(self.holder, event.medium), event.block_hashes)
                else:
                    stats.skipped += 1
            elif isinstance(event, AllBlocksCleared):
                stats.cleared += self.store.clear(self.holder)
        run.flush(self.store, stats)
        self.last_seq = batch.seq
        self.times.applied_s += step_clock() - began
        return stats

    def _stored(self, event: BlockStored, stats: IngestStats, run: _Run) -> None:
        holder = self.holder
        if event.medium not in INDEXED_MEDIA or event.group_idx not in INDEXED_GROUPS:
            if event.medium not in TIER_MEDIA or event.group_idx not in INDEXED_GROUPS:
                stats.skipped += 1
                return
            holder = tier_holder(holder, event.medium)
        if holder != run.holder:
            run.flush(self.store, stats)
            run.holder = holder
        began = step_clock()
        extras = event.extra_keys
        first = event.parent_block_hash is None
        plain = extras is None or all(extra is None for extra in extras[1 if first else 0 :])
        if first:
            head = split_extra_keys(None if extras is None else extras[0], event.lora_name, first_block=True)
            parent: int | None = self._root(head.lora_name, head.cache_salt)
            plain = plain and head.other is None
        else:
            parent = run.recent.get(event.parent_block_hash) if run.recent else None
            if parent is None:
                parent = self.store.own_key(holder, event.parent_block_hash)
            if parent is None and holder is not self.holder:
                parent = self._tier_parent(event.parent_block_hash)
            if parent is None:
                stats.orphaned += 1
                self.times.keys_s += step_clock() - began
                return
        size = event.block_size
        if plain:
            keys = chain_from(parent, event.token_ids, size)  # no per-block extras: one pass over the bytes
        else:
            keys = []
            for i in range(len(event.block_hashes)):
                extra = None if extras is None else extras[i]
                other = split_extra_keys(extra, event.lora_name, first_block=first and i == 0).other
                parent = next_key(parent, event.token_ids[i * size : (i + 1) * size], other)
                keys.append(parent)
        self.times.keys_s += step_clock() - began
        stats.stored_keys.extend(keys)
        self.block_size = size
        run.add(event.block_hashes, keys)

    def _tier_parent(self, engine_hash: int) -> int | None:
        """A tier block's parent held elsewhere in the engine (an engine hash names the same content in
        every medium, so any of its holders gives the same own key)."""
        for holder in (self.holder, *(tier_holder(self.holder, m) for m in TIER_MEDIA)):
            key = self.store.own_key(holder, engine_hash)
            if key is not None:
                return key
        return None

    def _root(self, lora_name: str | None, cache_salt: str | None) -> int:
        """The chain seed, remembered per (LoRA, salt): one hash per prefill event less."""
        seeds = self._roots
        seed = seeds.get((lora_name, cache_salt))
        if seed is None:
            if len(seeds) >= _MAX_ROOTS:
                seeds.clear()
            seed = seeds[lora_name, cache_salt] = root_seed(self.model, lora_name, cache_salt)
        return seed

    def reset(self) -> int:
        """The stream's publisher restarted: its cache and lower tiers are empty; returns the blocks dropped."""
        return clear_source(self.store, self.holder)
