"""Which router replicas own (subscribe to) which engine's event stream: rendezvous hashing.

Highest-random-weight hashing gives every (engine, member) pair a fixed score; an engine's owners are
the members with the highest scores. When a member dies only the engines it owned move, each to the
next member in its own order, so a membership change never reshuffles the whole fleet.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def _weight(engine_id: str, member_id: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{member_id}\x00{engine_id}".encode())


def owners(engine_id: str, live_member_ids: Iterable[str], redundancy: int = 2) -> list[str]:
    """The ``redundancy`` members that should own ``engine_id``, best first (deterministic everywhere)."""
    if redundancy < 1:
        raise ValueError("redundancy must be at least 1")
    ranked = sorted(set(live_member_ids), key=lambda m: (_weight(engine_id, m), m), reverse=True)
    return ranked[:redundancy]


def owned_engines(
    member_id: str, engine_ids: Iterable[str], live_member_ids: Iterable[str], redundancy: int = 2
) -> set[str]:
    """The engines whose event streams ``member_id`` must subscribe to."""
    live = set(live_member_ids)
    return {e for e in engine_ids if member_id in owners(e, live, redundancy)}
