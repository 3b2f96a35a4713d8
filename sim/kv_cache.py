"""Paged KV cache with prefix caching, mirroring vLLM v1's BlockPool (sans-IO).

Semantics kept from vLLM because a router can observe them through events and hit rates:
- block 0 is the null block and never holds data, so `num_blocks - 1` blocks are usable;
- only full blocks get a hash and become reusable; each one is announced by BlockStored;
- a request holds a reference on each of its blocks; freed blocks (ref 0) go to the TAIL of the
  free queue, allocation pops from the HEAD, and a popped block that still has a hash is evicted
  (one BlockRemoved per block) - so eviction is LRU over free blocks only;
- a cached block with ref 0 sits in the free queue and is revived (removed from it) by a hit;
- identical blocks computed concurrently are not de-duplicated (block tables are append-only):
  the hash maps to several block ids and the first one is served.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter as a request names it: what vLLM's events carry (``lora_name``, ``lora_id``) and what
    its block hashes are keyed with (name and path)."""

    name: str
    path: str
    id: int


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple[Any, ...] | None]
    medium: str = "GPU"
    lora: Adapter | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored_run(hashes: Sequence[bytes], start: int, end: int, token_ids: Sequence[int], block_size: int,
               extra_keys: Sequence[tuple[Any, ...] | None], lora: Adapter | None, medium: str = "GPU") -> BlockStored:
    """The event announcing blocks ``start..end-1`` of a sequence (``token_ids``/``extra_keys`` cover all of it)."""
    return BlockStored(
        block_hashes=list(hashes[start:end]),
        parent_block_hash=hashes[start - 1] if start > 0 else None,
        token_ids=list(token_ids[start * block_size : end * block_size]),
        block_size=block_size,
        extra_keys=list(extra_keys[start:end]),
        medium=medium,
        lora=lora,
    )


@dataclass(slots=True)
class KVCache:
    """The block pool of one engine. Events accumulate until `drain_events` (one batch per step)."""

    num_blocks: int
    block_size: int
    blocks: list[Block] = field(init=False)
    _free: OrderedDict[int, Block] = field(init=False)
    _cached: dict[bytes, dict[int, Block]] = field(init=False)
    _events: list[KVEvent] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1:
            raise ValueError("need num_blocks >= 2 (block 0 is the null block) and block_size >= 1")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached = {}
        self._events = []

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, possibly holding evictable cached data)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """vllm:kv_cache_usage_perc: the share of usable blocks held by requests."""
        return 1.0 - len(self._free) / self.usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(v) for v in self._cached.values())

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def free_queue_ids(self) -> list[int]:
        """Block ids in eviction order (head first); for tests and debugging."""
        return list(self._free)

    def find_cached_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[Block]:
        """The longest run of leading hashes that are cached (no side effects)."""
        hit: list[Block] = []
        for h in hashes[:max_blocks]:
            holders = self._cached.get(h)
            if not holders:
                break
            hit.append(next(iter(holders.values())))
        return hit

    def evictable_among(self, blocks: Sequence[Block]) -> int:
        """How many of these blocks would leave the free queue if touched."""
        return sum(1 for b in blocks if b.ref_cnt == 0)

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on hit blocks; a free one is revived (leaves the free queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block] | None:
        """Pop `n` blocks from the head of the free queue, evicting their cached data; None if short."""
        if n > len(self._free):
            return None
        out: list[Block] = []
        for _ in range(n):
            _, b = self._free.popitem(last=False)
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        if b.block_hash is None:
            return
        holders = self._cached.get(b.block_hash)
        if holders is not None and holders.pop(b.block_id, None) is not None:
            if not holders:
                del self._cached[b.block_hash]
            self._events.append(BlockRemoved([b.block_hash]))
        b.block_hash = None

    def cache_blocks(
        self,
        blocks: Sequence[Block],
        hashes: Sequence[bytes],
        start: int,
        end: int,
        token_ids: Sequence[int],
        extra_keys: Sequence[tuple[Any, ...] | None],
        lora: Adapter | None = None,
    ) -> None:
        """Register blocks[start:end] (now full) under their hashes and announce them in one event.

        `token_ids` and `extra_keys` cover the whole sequence; the event carries the slice.
        """
        if end <= start:
            return
        for i in range(start, end):
            b = blocks[i]
            b.block_hash = hashes[i]
            self._cached.setdefault(hashes[i], {})[b.block_id] = b
        self._events.append(stored_run(hashes, start, end, token_ids, self.block_size, extra_keys, lora))

    def announce_reused(
        self, hashes: Sequence[bytes], token_ids: Sequence[int], extra_keys: Sequence[tuple[Any, ...] | None],
        lora: Adapter | None = None,
    ) -> None:
        """kv_cache_report_mode=full: re-announce hit blocks, with parent None as vLLM does."""
        if not hashes:
            return
        n = len(hashes)
        self._events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=None,
                token_ids=list(token_ids[: n * self.block_size]),
                block_size=self.block_size,
                extra_keys=list(extra_keys[:n]),
                lora=lora,
            )
        )

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop a request's references, tail block first so chains are evicted from their end."""
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def reset(self) -> None:
        """Forget every cached hash (reset_prefix_cache); blocks held by requests stay allocated."""
        for b in self.blocks:
            b.block_hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())

    def extend_events(self, events: Sequence[KVEvent]) -> None:
        """Events of another tier of the engine, published in this step's batch."""
        self._events.extend(events)

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
