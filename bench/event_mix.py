"""A realistic KV-event mix of one synthetic engine (sans-IO): what a busy vLLM engine's steps publish.

One batch is one scheduler step of one data-parallel rank. A step admits a new request now and then, whose
uncached prompt blocks arrive as one ``BlockStored`` of 1-500 blocks (most short, a long tail: a Pareto
draw, median about 8 blocks), and every running request that filled a block emits a single-block
``BlockStored`` chained onto its previous block (decode). Finished requests' blocks become evictable; once
the rank holds its cap, the oldest evictable blocks go, one ``BlockRemoved`` per block as vLLM sends them.
Rarely the cache is reset (``AllBlocksCleared``). Block ops are counted as the router counts them: one
per block stored or removed.

Each rank remembers its live blocks with the own keys a router derives from their token ids, so the
publisher can state the digest an exact replica reports (``index.digest.block_set_digest``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgpack

from index.block_hash import KEY_MASK, chain_from, engine_hash_to_int, root_seed
from index.digest import block_set_digest
from sim.event_encoding import Encoding, encode_batch, encode_event, event_fields
from sim.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored

BLOCK_SIZE = 16
VOCAB = 151_000
MAX_PREFILL_BLOCKS = 500
PARETO_ALPHA = 1.1
"""Prefill sizes: ``min(500, ceil(4 * pareto(1.1)))`` blocks gives a median near 8, a mean near 25 and
about 2% of prefills at the 500-block cap (a quarter of the rank's cache, if smaller)."""
RUNNING = 16
"""Requests decoding at once on one rank."""
DECODE_SHARE = 0.3
"""Share of stored blocks that are decode blocks (the rest arrive in prefills)."""
CLEAR_EVERY_STEPS = 200_000
"""About one ``AllBlocksCleared`` per this many steps of a rank."""
_POOL = [random.Random(0).randrange(VOCAB) for _ in range(1 << 16)]


class EventTemplates:
    """Encoded events built by filling copies of what ``sim.event_encoding.encode_event`` gives for a template
    event, so field names, order and defaults stay the encoder's own: going through event objects and the
    generic encoder cost ~6.4 us per block op, more than the replica spends ingesting it, and the publisher of
    ``kvmesh bench scale`` shares the machine with the replicas it measures."""

    def __init__(self, encoding: Encoding) -> None:
        self._stored = encode_event(BlockStored([bytes(8)], None, [], BLOCK_SIZE, [None]), encoding)
        self._removed = encode_event(BlockRemoved([bytes(8)]), encoding)
        as_map = encoding == "map"
        names = [name for name, _ in event_fields(BlockStored([bytes(8)], None, [], BLOCK_SIZE, [None]))[1]]
        self._at = {name: (name if as_map else 1 + names.index(name))
                    for name in ("block_hashes", "parent_block_hash", "token_ids", "extra_keys")}
        self._removed_hashes: Any = "block_hashes" if as_map else 1

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int]) -> Any:
        """A ``BlockStored`` of u64 ``hashes`` after ``parent``, without extra keys."""
        event = self._stored.copy()
        at = self._at
        event[at["block_hashes"]] = hashes
        event[at["parent_block_hash"]] = parent
        event[at["token_ids"]] = tokens
        event[at["extra_keys"]] = [None] * len(hashes)
        return event

    def removed(self, block: int) -> Any:
        event = self._removed.copy()
        event[self._removed_hashes] = [block]
        return event

    @staticmethod
    def batch(ts: float, events: list[Any], rank: int) -> bytes:
        """What ``encode_batch`` gives for these events."""
        return msgpack.packb([ts, events, rank])


@dataclass(frozen=True, slots=True)
class MixBatch:
    payload: bytes
    stored: int
    removed: int
    cleared: bool = False

    @property
    def ops(self) -> int:
        return self.stored + self.removed


@dataclass(slots=True)
class _Request:
    last_hash: int
    last_key: int
    blocks: list[int] = field(default_factory=list)
    decode_left: int = 0


class MixEngine:
    """One data-parallel rank's block pool under the realistic mix."""

    def __init__(self, index: int, cap: int, model: str, encoding: Encoding = "map", seed: int = 0,
                 rank: int = 0) -> None:
        if cap < 4 * RUNNING:
            raise ValueError(f"the cap must hold at least {4 * RUNNING} blocks")
        self._max_prefill = min(MAX_PREFILL_BLOCKS, cap // 4)
        self.index = index
        self.rank = rank
        self.cap = cap
        self.encoding: Encoding = encoding
        self._encode = EventTemplates(encoding)
        self._root = root_seed(model)
        self._rng = random.Random((seed * 1_000_003 + index) * 64 + rank)
        self._requests = 0
        self._running: list[_Request] = []
        self._live: dict[int, int] = {}
        """engine hash (as the router folds it) -> own key, of every block this rank holds."""
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def full(self) -> bool:
        """Evictions have started (a rank stays at its cap from then on, until a reset)."""
        return self.live + self._max_prefill > self.cap

    def _prefill_blocks(self) -> int:
        return min(self._max_prefill, int(4 * self._rng.paretovariate(PARETO_ALPHA)) or 1)

    def _tokens(self, blocks: int) -> list[int]:
        """Tokens unique to this request (its first block differs from every other request's)."""
        n = blocks * BLOCK_SIZE
        start = self._rng.randrange(len(_POOL) - n)
        tokens = _POOL[start : start + n]
        tokens[0], tokens[1] = self._requests % VOCAB, self._requests // VOCAB % VOCAB
        tokens[2] = (self.index * 64 + self.rank) % VOCAB
        return tokens

    def _hash(self) -> int:
        return self._rng.getrandbits(64)

    def _admit(self, events: list[Any]) -> int:
        blocks = self._prefill_blocks()
        tokens = self._tokens(blocks)
        self._requests += 1
        draw = self._rng.getrandbits
        hashes = [draw(64) for _ in range(blocks)]
        keys = chain_from(self._root, tokens, BLOCK_SIZE)
        events.append(self._encode.stored(hashes, None, tokens))
        folded = [h & KEY_MASK for h in hashes]
        self._live.update(zip(folded, keys, strict=True))
        self._running.append(_Request(hashes[-1], keys[-1], folded, 1 + int(self._rng.expovariate(1 / 8))))
        return blocks

    def _decode(self, request: _Request, events: list[Any]) -> None:
        start = self._rng.randrange(len(_POOL) - BLOCK_SIZE)
        tokens = _POOL[start : start + BLOCK_SIZE]
        block = self._hash()
        key = chain_from(request.last_key, tokens, BLOCK_SIZE)[0]
        events.append(self._encode.stored([block], request.last_hash, tokens))
        request.last_hash, request.last_key = block, key
        request.blocks.append(block & KEY_MASK)
        self._live[block & KEY_MASK] = key
        request.decode_left -= 1

    def _finish(self, request: _Request) -> None:
        for block in request.blocks:
            self._evictable[block] = None

    def next_batch(self, ts: float, ops_wanted: int = 64) -> MixBatch:
        """The next step's events (about ``ops_wanted`` block ops), applied to this rank's live set."""
        events: list[Any] = []
        if self._rng.randrange(CLEAR_EVERY_STEPS) == 0:
            self._live.clear()
            self._evictable.clear()
            self._running.clear()
            return MixBatch(encode_batch(ts, [AllBlocksCleared()], self.encoding, self.rank), 0, 0, True)
        stored = 0
        decode_target = max(1, int(ops_wanted * DECODE_SHARE / 2))
        while self._running and stored < decode_target:
            for request in list(self._running):
                self._decode(request, events)
                stored += 1
                if request.decode_left <= 0:
                    self._running.remove(request)
                    self._finish(request)
                if stored >= decode_target:
                    break
        while stored < ops_wanted // 2 or len(self._running) < RUNNING // 2:
            stored += self._admit(events)
        while len(self._running) > RUNNING:
            self._finish(self._running.pop(0))
        removed = self._evict(events)
        return MixBatch(self._encode.batch(ts, events, self.rank), stored, removed)

    def _evict(self, events: list[Any]) -> int:
        """Oldest evictable blocks out until the rank is back at its cap."""
        excess = self.live - self.cap
        evictable, live, removal = self._evictable, self._live, self._encode.removed
        removed = 0
        while removed < excess and evictable:
            block, _ = evictable.popitem(last=False)
            del live[block]
            events.append(removal(block))
            removed += 1
        return removed

    def digest(self) -> str:
        """What ``GET /admin/index`` of a replica holding exactly this rank's live blocks says."""
        return block_set_digest([engine_hash_to_int(h) for h in self._live], list(self._live.values()))
