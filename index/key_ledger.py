"""The part of the block store that ingest alone needs, for a process that ingests for another one.

Deriving a stored block's own key needs its parent's own key, found by engine hash (``own_key``); a removal
names blocks by engine hash. Neither needs the mask table, which only routing reads. A replica that ingests
in a process of its own (gateway/ingest_worker.py) keeps these per-holder alias tables there, and every change
is also written to ``notes`` in order, for the serving process to apply to its full index (events/worker_notes.py):
the same calls with the same arguments, so both indexes end the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from index.alias_table import AliasTable
from index.tiers import source_of


class KeyLedger:
    """Engine hash -> own key per holder, with every change noted in order (``notes``; the caller empties it).

    Answers as ``PrefixIndex`` does for the calls ingest makes: ``store_many`` counts aliases that changed,
    ``remove`` and ``clear`` blocks that were held."""

    def __init__(self) -> None:
        self._aliases: dict[str, AliasTable] = {}
        self.notes: list[tuple[Any, ...]] = []
        self.noted_ops = 0
        """Block operations in ``notes``: the worker flushes before they grow past a bound."""

    def load(self, holder: str, engine_hashes: Sequence[int], own_keys: Sequence[int]) -> None:
        """Pairs the serving index already holds (a warm start, a restarted worker): not noted."""
        if len(engine_hashes):
            self._aliases.setdefault(holder, AliasTable()).put_many(engine_hashes, own_keys)

    def store_many(self, holder: str, engine_hashes: Sequence[int], own_keys: Sequence[int]) -> int:
        if not engine_hashes:
            return 0
        previous = self._aliases.setdefault(holder, AliasTable()).put_many(engine_hashes, own_keys)
        self.notes.append(("s", holder, engine_hashes, own_keys))
        self.noted_ops += len(engine_hashes)
        return sum(before != key for before, key in zip(previous, own_keys, strict=True))

    def store(self, holder: str, pairs: Sequence[tuple[int, int]]) -> int:
        return self.store_many(holder, [h for h, _ in pairs], [k for _, k in pairs])

    def remove(self, holder: str, engine_hashes: Iterable[int]) -> int:
        aliases = self._aliases.get(holder)
        if not aliases:
            return 0
        hashes = list(engine_hashes)
        removed = len(hashes) - aliases.pop_many(hashes).count(None)
        if not aliases:
            del self._aliases[holder]
        self.notes.append(("r", holder, hashes))
        self.noted_ops += len(hashes)
        return removed

    def clear(self, holder: str) -> int:
        aliases = self._aliases.pop(holder, None)
        if aliases is None:
            return 0
        self.notes.append(("c", holder))
        self.noted_ops += 1
        return len(aliases)

    def forget_source(self, holder: str) -> None:
        """Drop an event source's blocks and its tiers' without a note (its engine left the serving side too)."""
        for key in [key for key in self._aliases if source_of(key) == holder]:
            del self._aliases[key]

    def own_key(self, holder: str, engine_hash: int) -> int | None:
        aliases = self._aliases.get(holder)
        return aliases.get(engine_hash) if aliases is not None else None

    def block_count(self, holder: str) -> int:
        aliases = self._aliases.get(holder)
        return len(aliases) if aliases is not None else 0

    def engines(self) -> list[str]:
        return list(self._aliases)

    def export(self, holder: str) -> tuple[np.ndarray, np.ndarray]:
        aliases = self._aliases.get(holder)
        if aliases is None:
            return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)
        return aliases.arrays()
