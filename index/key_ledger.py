"""The part of the block store that ingest alone needs, for a process that ingests for another one.

Deriving a stored block's own key needs its parent's own key, found by engine hash (``own_key``); a removal
names blocks by engine hash. Neither needs the mask table, which only routing reads. A replica that ingests
in a process of its own (gateway/ingest_worker.py) keeps these per-holder alias tables there, and every change
is also written to ``notes`` in order, for the serving process to apply to its full index (events/worker_notes.py):
the same calls with the same arguments, so both indexes end the same.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from index.alias_table import AliasTable
from index.compiled import compiled
from index.paired_update import alias_put, pop_loop
from index.tiers import source_of

_KEY_LIMIT = 1 << 63


@compiled
def _put_loop(words, size, multiplier, engine_hashes, own_keys):
    """``AliasTable.put_many`` over pairs already range-checked; returns (aliases that changed, added, newly used
    slots)."""
    changed = added = used = 0
    for i in range(engine_hashes.shape[0]):
        existed, before, taken = alias_put(words, size, multiplier, engine_hashes[i], own_keys[i])
        if not existed:
            added += 1
            used += taken
            changed += 1
        elif before != own_keys[i]:
            changed += 1
    return changed, added, used


def _put(aliases: AliasTable, engine_hashes: Sequence[int], own_keys: Sequence[int]) -> int:
    """``aliases.put_many`` compiled (0.9 us a pair in Python); returns how many aliases changed."""
    hashes = np.asarray(engine_hashes, dtype=np.uint64)
    keys = np.asarray(own_keys, dtype=np.uint64)
    if len(hashes) != len(keys):
        raise ValueError("one own key per engine hash")
    if len(hashes) and int(hashes.max()) >= _KEY_LIMIT:
        raise ValueError("alias out of range: keys in [0, 2**63)")
    if aliases._used + len(hashes) > aliases.max_used():
        aliases._rebuild(len(hashes))
    changed, added, used = _put_loop(aliases.word_view(), aliases._size, np.uint64(aliases._multiplier), hashes, keys)
    aliases._live += added
    aliases._used += used
    return changed


def _pop(aliases: AliasTable, engine_hashes: Sequence[int]) -> int:
    """``aliases.pop_many`` compiled; returns how many were held."""
    keys = np.array([key for key in engine_hashes if 0 <= key < _KEY_LIMIT], dtype=np.uint64)
    popped = pop_loop(aliases.word_view(), aliases._size, np.uint64(aliases._multiplier), keys,
                      np.empty(len(keys), dtype=np.uint64))
    aliases._live -= popped
    aliases.shrink_if_sparse()
    return popped


@functools.cache
def load_ledger_loops() -> None:
    """Run the ledger's compiled loops once, so the ingest process's first events do not load or compile them."""
    aliases = AliasTable()
    _put(aliases, [1, 2], [3, 4])
    _pop(aliases, [1, 2])


class KeyLedger:
    """Engine hash -> own key per holder, with every change noted in order (``notes``; the caller empties it).

    Answers as ``PrefixIndex`` does for the calls ingest makes: ``store_many`` counts aliases that changed,
    ``remove`` and ``clear`` blocks that were held."""

    def __init__(self) -> None:
        load_ledger_loops()
        self._aliases: defaultdict[str, AliasTable] = defaultdict(AliasTable)
        """A holder's table is made on its first block, once (a new table draws a secret multiplier); lookups use
        ``get``, which makes none."""
        self.notes: list[tuple[Any, ...]] = []
        self.noted_ops = 0
        """Block operations in ``notes``: the worker flushes before they grow past a bound."""

    def load(self, holder: str, engine_hashes: Sequence[int], own_keys: Sequence[int]) -> None:
        """Pairs the serving index already holds (a warm start, a restarted worker): not noted."""
        if len(engine_hashes):
            _put(self._aliases[holder], engine_hashes, own_keys)

    def store_many(self, holder: str, engine_hashes: Sequence[int], own_keys: Sequence[int]) -> int:
        if not engine_hashes:
            return 0
        changed = _put(self._aliases[holder], engine_hashes, own_keys)
        self.notes.append(("s", holder, engine_hashes, own_keys))
        self.noted_ops += len(engine_hashes)
        return changed

    def remove(self, holder: str, engine_hashes: Iterable[int]) -> int:
        aliases = self._aliases.get(holder)
        if not aliases:
            return 0
        hashes = list(engine_hashes)
        removed = _pop(aliases, hashes)
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
