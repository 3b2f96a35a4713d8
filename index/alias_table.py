"""A compact engine-hash -> own-key map: open addressing over one array of unsigned 64-bit words.

The alias map holds one entry per block an engine caches: with dicts the index took 155 bytes per block
held, with these tables 113 (``kvmesh bench index``, 1M blocks). Two u64 words at a load factor of
0.45-0.65 cost 25-36 bytes per entry. The map is only
touched when events arrive, never on the routing lookup, so single operations probe in Python; growing
re-inserts every entry in one compiled loop (index/alias_words.py) so a million-block engine does not pause the
event loop.

Slots come from multiplying the key by a secret odd number chosen per table, so an engine that sends
crafted hashes cannot pile them onto one probe chain.
"""

from __future__ import annotations

import math
import secrets
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from index.alias_words import TOMBSTONE, reinsert_live

_U64 = (1 << 64) - 1
_EMPTY = 0
_TOMBSTONE = int(TOMBSTONE)
"""A removed entry's key word as a Python int, which the probes in Python compare."""
_MIN_SIZE = 8
_MAX_LOAD = 0.65
"""Grow (or sweep tombstones) above this share of used slots: linear probes stay short."""
_REBUILT_LOAD = 0.45
"""A rebuilt table's load. Any table size is allowed (the home slot is a multiply-shift range reduction,
not a power-of-two mask), so the load stays in 0.45-0.65. An engine at its cap sweeps its tombstones back to
this load over and over, so a full engine's table costs 16 B / 0.45 per block for good: 36 B (at 0.35 it was
46 B). The band was 0.55-0.75 while a dict of own keys took most of the index's memory, and 0.35-0.55 after;
the longer probes of this band cost about 0.05 us per block op on the realistic mix (``kvmesh bench ingest
--engines 16 --cap 50000 --against``: 1.65 against 1.60 us, per-pair ratios 0.80-1.08), and at 65,536 blocks
an engine, where the mask table's old limit had doubled it, the two changes measured 1.58 against 2.01."""
_KEY_LIMIT = 1 << 63


def storable(key: int, value: int) -> bool:
    """Whether the table can hold this pair: keys below 2**63 (engine hashes are folded to 60 bits), u64 values."""
    return 0 <= key < _KEY_LIMIT and 0 <= value <= _U64


@dataclass(frozen=True, slots=True)
class RebuiltAliases:
    """An alias table's words rebuilt without tombstones (``AliasTable.rebuilt``), ready to be adopted."""

    size: int
    words: array
    live: int


class AliasTable:
    """Mapping-like table of int keys in [0, 2**63) to int values in [0, 2**64)."""

    __slots__ = ("_words", "_size", "_live", "_used", "_multiplier")

    def __init__(self) -> None:
        self._multiplier = secrets.randbits(64) | 1
        self._allocate(_MIN_SIZE)

    def _allocate(self, size: int) -> None:
        self._words = array("Q", (0,)) * (2 * size)
        self._size = size
        self._live = 0
        self._used = 0

    def __len__(self) -> int:
        return self._live

    def word_view(self) -> np.ndarray:
        """The words as a u64 numpy array sharing their memory (for the compiled loops of
        index/paired_update.py)."""
        return np.frombuffer(self._words, dtype=np.uint64)

    def max_used(self) -> int:
        """Slots in use (live or tombstone) past which an insert rebuilds the table first."""
        return int(_MAX_LOAD * self._size)

    def shrink_if_sparse(self) -> None:
        """After removals: a table less than an eighth full is rebuilt smaller."""
        if self._size > _MIN_SIZE and self._live < self._size // 8:
            self._rebuild()

    def _home(self, stored: int) -> int:
        """The top 32 bits of the scrambled key, scaled to the table's size (numpy computes the same)."""
        return (((stored * self._multiplier) & _U64) >> 32) * self._size >> 32

    def get(self, key: int, default: int | None = None) -> int | None:
        """The probe loop inlined: a decode event looks its parent up here, one call per stored event."""
        if not 0 <= key < _KEY_LIMIT:
            return default
        words, size = self._words, self._size
        stored = key + 1
        slot = (((stored * self._multiplier) & _U64) >> 32) * size >> 32
        while True:
            current = words[2 * slot]
            if current == stored:
                return words[2 * slot + 1]
            if current == _EMPTY:
                return default
            slot = slot + 1 if slot + 1 < size else 0

    def __setitem__(self, key: int, value: int) -> None:
        self.put_many((key,), (value,))

    def pop(self, key: int, default: int | None = None) -> int | None:
        value = self.pop_many((key,))[0]
        return default if value is None else value

    def put_many(self, keys: Sequence[int], values: Sequence[int]) -> list[int | None]:
        """Set every pair in order; returns each key's previous value (None: new). One call per event:
        the probing loop inlined here cost 0.9 us per pair against 2.4 us through ``get`` and ``[]=``."""
        if keys and not (min(keys) >= 0 and max(keys) < _KEY_LIMIT and min(values) >= 0 and max(values) <= _U64):
            raise ValueError("alias out of range: keys in [0, 2**63), values in [0, 2**64)")
        if self._used + len(keys) > self.max_used():
            self._rebuild(len(keys))
        words, size, multiplier = self._words, self._size, self._multiplier
        end = 2 * size
        previous: list[int | None] = []
        added = used = 0
        for key, value in zip(keys, values, strict=True):
            stored = key + 1
            at = 2 * ((((stored * multiplier) & _U64) >> 32) * size >> 32)  # the word of the home slot
            reusable = -1
            current = words[at]
            while current != stored and current:
                if current == _TOMBSTONE and reusable < 0:
                    reusable = at
                at = at + 2 if at + 2 < end else 0
                current = words[at]
            if current:
                previous.append(words[at + 1])
                words[at + 1] = value
                continue
            if reusable < 0:
                reusable = at
                used += 1
            words[reusable] = stored
            words[reusable + 1] = value
            previous.append(None)
            added += 1
        self._live += added
        self._used += used
        return previous

    def pop_many(self, keys: Iterable[int]) -> list[int | None]:
        """Remove every key in order; returns each one's value (None: it was not held)."""
        words, size, multiplier = self._words, self._size, self._multiplier
        end = 2 * size
        values: list[int | None] = []
        removed = 0
        for key in keys:
            if not 0 <= key < _KEY_LIMIT:
                values.append(None)
                continue
            stored = key + 1
            at = 2 * ((((stored * multiplier) & _U64) >> 32) * size >> 32)
            current = words[at]
            while current != stored and current:
                at = at + 2 if at + 2 < end else 0
                current = words[at]
            if current:
                values.append(words[at + 1])
                words[at] = _TOMBSTONE
                words[at + 1] = 0
                removed += 1
            else:
                values.append(None)
        self._live -= removed
        self.shrink_if_sparse()
        return values

    def _pairs(self) -> np.ndarray:
        """Live (stored key, value) rows, as a numpy view's copy."""
        rows = np.frombuffer(self._words, dtype=np.uint64).reshape(-1, 2)
        keys = rows[:, 0]
        return rows[(keys != _EMPTY) & (keys != _TOMBSTONE)].copy()

    def items(self) -> Iterator[tuple[int, int]]:
        for stored, value in self._pairs().tolist():
            yield stored - 1, value

    def values(self) -> list[int]:
        return self._pairs()[:, 1].tolist()

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) of every live entry as u64 arrays, without a Python object per entry."""
        pairs = self._pairs()
        return pairs[:, 0] - np.uint64(1), pairs[:, 1].copy()

    def _rebuild(self, incoming: int = 0) -> None:
        """Re-insert the live entries into a table they (and ``incoming`` more) fill to ``_REBUILT_LOAD``,
        dropping tombstones."""
        self.adopt(self.rebuilt(incoming))

    def rebuilds_soon(self, min_slots: int) -> bool:
        """Whether this table has at least ``min_slots`` slots and a sixteenth of them in inserts could make
        one rebuild it first (grow it, or sweep its tombstones)."""
        return self._size >= min_slots and self._used + self._size // 16 > self.max_used()

    def rebuilt(self, incoming: int = 0) -> RebuiltAliases:
        """The words of ``_rebuild(incoming)``, built without changing this table: it only reads it, so it may
        run in a worker thread while the event loop reads the table too (never while it writes it). The
        compiled loop (index/alias_words.py) releases the GIL, so that thread does not hold the loop."""
        size = max(_MIN_SIZE, math.ceil((self._live + incoming) / _REBUILT_LOAD))
        words = array("Q", (0,)) * (2 * size)
        live = reinsert_live(self.word_view(), np.uint64(self._multiplier), np.frombuffer(words, dtype=np.uint64),
                             size)
        if live < 0:
            raise RuntimeError("alias table written while it was rebuilt")
        return RebuiltAliases(size, words, live)

    def adopt(self, rebuilt: RebuiltAliases) -> None:
        """Take the words ``rebuilt`` from this table's current entries."""
        self._words, self._size = rebuilt.words, rebuilt.size
        self._live = self._used = rebuilt.live
