"""Stable hashes for key-based routing: blake2b-64, and rendezvous ranking with a murmur3 fmix64 mix.

Rendezvous (highest random weight) hashing ranks engines by ``mix(key, engine)``: the order does not
depend on the order engines are listed in, and when one engine leaves only the keys it ranked first
move (about 1/N of them), each to its own runner-up.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable

_MASK = (1 << 64) - 1
PREFIX_CHARS = 256


def fmix64(h: int) -> int:
    """murmur3's finaliser: spreads every bit of a combination of two hashes."""
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _MASK
    h ^= h >> 33
    return h


def key_hash(key: str) -> int:
    """A key's 64-bit hash, the same on every replica, process and platform. blake2b in C takes ~1 us;
    FNV-1a in Python took ~50 us for a prefix key (fresh per request: a user turn is part of it)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def prefix_key(model: str, system: str, first_user: str) -> str:
    """The routing key of the prefix_hash policy: model + first 256 chars of system and first user turn."""
    return f"{model}\x1f{system[:PREFIX_CHARS]}\x1f{first_user[:PREFIX_CHARS]}"


@functools.lru_cache(maxsize=65_536)
def _engine_hash(engine_id: str) -> int:
    """An engine id's ``key_hash``, kept: a decision ranks every engine by rendezvous weight, and the ids of a fleet
    are few and long-lived (bounded anyway: ids come from the registry, not from clients)."""
    return key_hash(engine_id)


def rendezvous_weight(key_h: int, engine_id: str) -> int:
    return fmix64(key_h ^ _engine_hash(engine_id))


def rendezvous_order(key: str, engine_ids: Iterable[str]) -> list[str]:
    """Engine ids ordered by descending rendezvous weight for ``key`` (ties, astronomically rare, by id)."""
    h = key_hash(key)
    return sorted(engine_ids, key=lambda e: (-rendezvous_weight(h, e), e))
