"""An LRU cache of segment tokenizations, bounded by the total number of cached tokens.

Keyed by (tokenizer id, segment text): the same system prompt under two tokenizers is two entries.
Bounding by tokens rather than entries keeps memory predictable when segment sizes vary from a few
tokens (``<|im_end|>\\n``) to a 30k-token document.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0
    """Segments larger than the whole cache, never stored."""


class TokenCache:
    """Sans-IO LRU map from (tokenizer id, text) to token ids; ``capacity`` counts tokens."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.tokens = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tokenizer_id: str, text: str) -> tuple[int, ...] | None:
        """The cached ids, refreshed as most recently used; None (and a miss counted) if absent."""
        key = (tokenizer_id, text)
        ids = self._entries.get(key)
        if ids is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return ids

    def peek(self, tokenizer_id: str, text: str) -> tuple[int, ...] | None:
        """The cached ids without counting a hit or refreshing the entry (the lookup that follows does)."""
        return self._entries.get((tokenizer_id, text))

    def put(self, tokenizer_id: str, text: str, ids: tuple[int, ...]) -> None:
        """Store ids, evicting least recently used entries until the token budget holds."""
        size = max(len(ids), 1)
        if size > self.capacity:
            self.stats.rejected += 1
            return
        key = (tokenizer_id, text)
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= max(len(old), 1)
        self._entries[key] = ids
        self.tokens += size
        while self.tokens > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            self.tokens -= max(len(evicted), 1)
            self.stats.evictions += 1

    def clear(self, tokenizer_id: str) -> None:
        """Forget one tokenizer's entries (after its segments were found not to be independent)."""
        for key in [k for k in self._entries if k[0] == tokenizer_id]:
            self.tokens -= max(len(self._entries.pop(key)), 1)
