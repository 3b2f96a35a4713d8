"""Synthetic vLLM engines for ``kvmesh bench scale`` (sans-IO): KV-event batches at a paced block-op rate.

Each batch is one engine step: a chain of ``CHAIN_BLOCKS`` new blocks of ``BLOCK_SIZE`` tokens (one
BlockStored, no parent, u64 hashes, token ids) and, once the engine holds its cap, one BlockRemoved per
evicted hash, oldest first, as vLLM sends them. Each engine remembers its live blocks together with the
own keys a router derives from their token ids, so the publisher can state the digest an exact replica
reports for that engine (``index.digest.block_set_digest``).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from index.block_hash import chain, engine_hash_to_int, root_seed
from index.digest import block_set_digest
from sim.event_encoding import Encoding, encode_batch
from sim.kv_cache import BlockRemoved, BlockStored, KVEvent

CHAIN_BLOCKS = 32
BLOCK_SIZE = 16
VOCAB = 151_000
"""Token ids drawn below a real vocabulary's size, so they encode to as many bytes as real ones."""
_POOL = [random.Random(0).randrange(VOCAB) for _ in range(1 << 16)]


class Pacer:
    """When the next batch is due for a steady total of ``ops_per_s`` block ops from ``start``.

    Behind schedule the next batch is due at once (the publisher catches up as fast as it can) and
    ``behind_s`` says by how much the schedule slipped.
    """

    def __init__(self, ops_per_s: float, start: float) -> None:
        if ops_per_s <= 0:
            raise ValueError("the block-op rate must be positive")
        self.ops_per_s = ops_per_s
        self.start = start

    def due_at(self, published_ops: int) -> float:
        return self.start + published_ops / self.ops_per_s

    def wait_s(self, now: float, published_ops: int) -> float:
        """Seconds until the next batch is due (0: publish now)."""
        return max(0.0, self.due_at(published_ops) - now)

    def behind_s(self, now: float, published_ops: int) -> float:
        return max(0.0, now - self.due_at(published_ops))


@dataclass(frozen=True, slots=True)
class Batch:
    payload: bytes
    stored: int
    removed: int

    @property
    def ops(self) -> int:
        return self.stored + self.removed


class SyntheticEngine:
    """One engine's block pool: chains in, oldest blocks out at the cap, payloads in vLLM's encoding."""

    def __init__(self, index: int, cap: int, model: str, encoding: Encoding = "map", seed: int = 0) -> None:
        if cap < CHAIN_BLOCKS:
            raise ValueError(f"the cap must hold at least one chain ({CHAIN_BLOCKS} blocks)")
        self.index = index
        self.cap = cap
        self.encoding: Encoding = encoding
        self._root = root_seed(model)
        self._rng = random.Random(seed * 1_000_003 + index)
        self._chains = 0
        self._hashes: deque[int] = deque()
        self._own_keys: deque[int] = deque()

    @property
    def live(self) -> int:
        return len(self._hashes)

    @property
    def full(self) -> bool:
        return self.live + CHAIN_BLOCKS > self.cap

    def _tokens(self) -> list[int]:
        """Token ids unique to this chain of this engine (its first block differs from every other's)."""
        n = CHAIN_BLOCKS * BLOCK_SIZE
        start = (self._chains * 977) % (len(_POOL) - n)
        tokens = _POOL[start : start + n]
        tokens[0], tokens[1], tokens[2] = self._chains % VOCAB, self._chains // VOCAB % VOCAB, self.index % VOCAB
        return tokens

    def next_batch(self, ts: float) -> Batch:
        """The next step's events, applied to this engine's live set."""
        tokens = self._tokens()
        self._chains += 1
        hashes = [self._rng.getrandbits(64) for _ in range(CHAIN_BLOCKS)]
        evict = max(0, self.live + CHAIN_BLOCKS - self.cap)
        events: list[KVEvent] = []
        for _ in range(evict):
            self._own_keys.popleft()
            events.append(BlockRemoved([self._hashes.popleft().to_bytes(8, "big")]))
        events.append(BlockStored([h.to_bytes(8, "big") for h in hashes], None, tokens, BLOCK_SIZE,
                                  [None] * CHAIN_BLOCKS))
        self._hashes.extend(hashes)
        self._own_keys.extend(chain(tokens, BLOCK_SIZE, self._root))
        return Batch(encode_batch(ts, events, self.encoding), CHAIN_BLOCKS, evict)

    def digest(self) -> str:
        """What ``GET /admin/index`` of a replica holding exactly this engine's live blocks says."""
        return block_set_digest([engine_hash_to_int(h) for h in self._hashes], list(self._own_keys))
