"""Store keys of an engine's event sources: one per data-parallel rank, each rank's blocks apart.

A data-parallel engine is one URL whose ranks each have their own KV cache and event stream. Each rank's
blocks live in the store under a holder key of their own: the engine id for its first rank,
``<engine>#dp<rank>`` for the others, so that one rank's restart clears that rank alone. The engine holds a
block when any rank does.
"""

from __future__ import annotations

from collections.abc import Sequence

from index.tiers import source_of

_RANK_MARK = "#dp"


def holder_keys(engine: str, ranks: Sequence[int]) -> tuple[str, ...]:
    """The store keys of an engine's event sources, in order: the engine id for the first, one per further
    data-parallel rank (with a single source, the engine id alone: no cost without data parallelism)."""
    return tuple(engine if i == 0 else f"{engine}{_RANK_MARK}{rank}" for i, rank in enumerate(ranks))


def engine_of(holder: str) -> str:
    """The engine a holder key belongs to (the key itself for a first rank); a rank's lower tiers
    (index/tiers.py) belong to its engine too."""
    engine, mark, rank = source_of(holder).rpartition(_RANK_MARK)
    return engine if mark and engine and rank.isdigit() else source_of(holder)
