"""Stable hashes for key-based routing: FNV-1a 64 with a murmur3 fmix64 finaliser, and rendezvous ranking.

Rendezvous (highest random weight) hashing ranks engines by ``mix(key, engine)``: the order does not
depend on the order engines are listed in, and when one engine leaves only the keys it ranked first
move (about 1/N of them), each to its own runner-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

_MASK = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
PREFIX_CHARS = 256


def fnv1a64(data: bytes) -> int:
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _MASK
    return h


def fmix64(h: int) -> int:
    """murmur3's finaliser: FNV-1a alone clusters on similar short keys; this spreads every bit."""
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _MASK
    h ^= h >> 33
    return h


@lru_cache(maxsize=65536)
def key_hash(key: str) -> int:
    """Cached: prefix and session keys recur (shared system prompts), and FNV-1a in Python costs ~50 us."""
    return fmix64(fnv1a64(key.encode("utf-8", "surrogatepass")))


def prefix_key(model: str, system: str, first_user: str) -> str:
    """The routing key of the prefix_hash policy: model + first 256 chars of system and first user turn."""
    return f"{model}\x1f{system[:PREFIX_CHARS]}\x1f{first_user[:PREFIX_CHARS]}"


def rendezvous_weight(key_h: int, engine_id: str) -> int:
    return fmix64(key_h ^ key_hash(engine_id))


def rendezvous_order(key: str, engine_ids: Iterable[str]) -> list[str]:
    """Engine ids ordered by descending rendezvous weight for ``key`` (ties, astronomically rare, by id)."""
    h = key_hash(key)
    return sorted(engine_ids, key=lambda e: (-rendezvous_weight(h, e), e))
