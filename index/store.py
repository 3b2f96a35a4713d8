"""The block store interface: what ingest, lookups and index transfer need of the index (``PrefixIndex``).

What is stored is, per engine, a map engine_hash -> own_key: exactly the state a starting replica is
sent by a peer (gateway/index_transfer.py). Lookup is by own keys (see index/block_hash.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np


class BlockStore(Protocol):
    """Per-engine block sets keyed by engine hash, with a longest-prefix lookup by own key."""

    def store(self, engine: str, pairs: Sequence[tuple[int, int]]) -> int:
        """Record (engine_hash, own_key) pairs held by `engine`; returns how many aliases changed."""
        ...

    def store_many(self, engine: str, engine_hashes: Sequence[int], own_keys: Sequence[int]) -> int:
        """``store`` of the pairs ``zip(engine_hashes, own_keys)``, without building them (one event's chain)."""
        ...

    def remove(self, engine: str, engine_hashes: Iterable[int]) -> int:
        """Forget blocks by engine hash (BlockRemoved); returns how many were held."""
        ...

    def clear(self, engine: str) -> int:
        """Drop every block of `engine` (AllBlocksCleared, restart); returns how many were held."""
        ...

    def own_key(self, engine: str, engine_hash: int) -> int | None:
        """The own key behind an engine hash, used to chain a BlockStored onto its parent."""
        ...

    def holds(self, engine: str, own_key: int) -> bool:
        """Whether `engine` holds the block with this own key."""
        ...

    def overlap(self, chain: Sequence[int], engines: Iterable[str] | None = None) -> dict[str, int]:
        """Per engine, how many LEADING blocks of `chain` it holds (engines holding none are omitted)."""
        ...

    def block_count(self, engine: str) -> int:
        """Number of distinct engine hashes held by `engine`."""
        ...

    def engines(self) -> list[str]:
        """Engines that currently hold at least one block."""
        ...

    def unique_blocks(self) -> dict[str, int]:
        """Per engine (data-parallel ranks together), blocks no other engine holds; kept as blocks change."""
        ...

    def export(self, engine: str) -> tuple[np.ndarray, np.ndarray]:
        """One engine's (engine hashes, own keys) as u64 arrays."""
        ...
