"""Sans-IO approximate entries: blocks the router believes an engine holds because it sent them there.

Two uses: engines without KV events (generic OpenAI servers, events off) keep what was dispatched
to them, bounded by their cache capacity (LRU) and a TTL; engines with events get short-lived
speculative entries at dispatch time so a burst of sibling requests does not race ahead of the
events, and those entries are discarded once the real BlockStored arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class ApproximateIndex:
    """Per engine an LRU of own keys with expiry times."""

    def __init__(self, default_capacity: int = 100_000) -> None:
        self._entries: dict[str, OrderedDict[int, float]] = {}
        self._capacity: dict[str, int] = {}
        self._default_capacity = default_capacity

    def set_capacity(self, engine: str, blocks: int) -> None:
        self._capacity[engine] = max(0, blocks)
        self._trim(engine)

    def record(self, engine: str, chain: Sequence[int], now: float, ttl_s: float) -> None:
        entries = self._entries.setdefault(engine, OrderedDict())
        expires = now + ttl_s
        for key in chain:
            entries[key] = expires
            entries.move_to_end(key)
        self._trim(engine)

    def _trim(self, engine: str) -> None:
        entries = self._entries.get(engine)
        if entries is None:
            return
        capacity = self._capacity.get(engine, self._default_capacity)
        while len(entries) > capacity:
            entries.popitem(last=False)

    def leading(self, engine: str, chain: Sequence[int], now: float, start: int = 0) -> int:
        """Length of the leading run of `chain` covered, given the first `start` blocks are known held."""
        entries = self._entries.get(engine)
        depth = min(start, len(chain))
        if not entries:
            return depth
        while depth < len(chain):
            expires = entries.get(chain[depth])
            if expires is None:
                break
            if expires <= now:
                del entries[chain[depth]]
                break
            depth += 1
        return depth

    def discard(self, engine: str, keys: Iterable[int]) -> None:
        entries = self._entries.get(engine)
        if entries:
            for key in keys:
                entries.pop(key, None)

    def clear(self, engine: str) -> None:
        self._entries.pop(engine, None)

    def size(self, engine: str) -> int:
        return len(self._entries.get(engine, ()))
