"""Own key -> holder mask of every indexed block: open addressing over two arrays of unsigned 64-bit words.

This is the index's lookup side: routing reads it for a prompt's chain, ingest writes it once per block.
As a Python dict it held a 32-byte int object per block besides ~42 bytes of dict entry and index: 74 of
the index's 126 bytes of RSS per block at 4M blocks. Here a block costs one code word and one mask word at
a load of 0.3-0.6 (27-53 bytes; 32 at 1M and at 4M blocks) and no Python object.

Masks that fit in 63 bits (holder slots 0-62) are stored as they are, so the common single-holder block
needs no indirection; a wider mask is interned with a reference count and its slot holds ``WIDE | id``.

The table is keyed by a block's code: (own key + 1) times a secret odd number chosen per table, modulo
2**64 (never 0, and undone by the inverse). A slot is the code's top bits, so crafted prompts cannot pile
their keys onto one probe run, and the index keeps codes in its alias tables instead of own keys, so a
removal finds the block's slot with one shift, no multiply. A removal shifts the entries after it back
instead of leaving a tombstone, so the table is rebuilt (with numpy, all entries placed at once) only when
it doubles or shrinks, never to sweep tombstones: a sweep would re-place every block of the index.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from index.compiled import compiled

KEY_LIMIT = 1 << 63
"""Own keys are 60 bits (index/block_hash.py); any below this have a code."""
_U64 = (1 << 64) - 1
WIDE = 1 << 63
"""Masks from this bit up are interned; smaller ones are stored as they are."""
_MIN_SIZE = 8
_MAX_LOAD = 0.6
"""Double above this load: probes and back-shifts stay one or two slots long. At 0.5 a fleet of a power of two
of blocks sat just past the limit and paid 64 B per block (4M blocks: 124.6 B of RSS per block in
``kvmesh bench scale``, 81-85 B at 0.6 with the alias tables' band)."""
_FIRST_PART = 8
_COMPILED_MIN = 16
"""Parts of a chain at least this long are walked by compiled code: a call costs about 5 us with its
arguments, a probe in Python 0.6-0.9 us per key, so a prompt missed at its first blocks stays in Python."""
_DEPTHS = np.empty(64, dtype=np.int64)
_DROPPED = np.empty(64, dtype=np.uint64)
"""The compiled walk's rows (a walk of holders in slots 0-62 drops each at most once), reused by every call:
the walk holds the GIL and keeps nothing in them."""


@compiled
def mask_slot(table, shift, last, code):
    """The slot of a mask table's codes holding ``code``, or the empty slot where it would go (``MaskTable._find``,
    for the compiled loops)."""
    slot = np.int64(code >> shift)
    current = table[slot]
    while current != code and current != 0:
        slot = (slot + 1) & last
        current = table[slot]
    return slot


@compiled
def _walk_compiled(table, values, shift, multiplier, own_keys, start, alive, depths, dropped):
    """``MaskTable._walk`` compiled, for holders in slots 0-62: fills (depth, dropped holders) rows and returns
    (rows, keys walked, holders alive). It stops early when no holder is left, or at a key whose word is an
    interned wide mask (the caller finishes from there in Python)."""
    last = np.int64(table.shape[0] - 1)
    one = np.uint64(1)
    wide = np.uint64(WIDE)
    rows = 0
    for i in range(own_keys.shape[0]):
        code = (own_keys[i] + one) * multiplier
        mask = values[mask_slot(table, shift, last, code)]
        if mask >= wide:
            return rows, i, alive
        gone = alive & ~mask
        if gone != 0:
            depths[rows] = start + i
            dropped[rows] = gone
            rows += 1
            alive &= mask
            if alive == 0:
                return rows, i + 1, alive
    return rows, own_keys.shape[0], alive


@dataclass(frozen=True, slots=True)
class Regrown:
    """A mask table's slots rebuilt at another size (``MaskTable.regrown``), ready to be adopted."""

    size: int
    codes: array
    values: array
    live: int


class MaskTable:
    """Mapping of block codes (``code(own_key)``) to nonzero int masks; a block's mask is 0 when no holder has
    it. Codes and masks are two arrays of u64 words, one slot each (an empty slot is 0 in both)."""

    __slots__ = ("_codes", "_values", "_size", "_shift", "_live", "_multiplier", "_inverse", "_wide", "_wide_ids",
                 "_refs", "_free_ids", "_np_shift", "_np_multiplier")

    def __init__(self) -> None:
        self._set_multiplier(secrets.randbits(64) | 1)
        self._wide: list[int] = []
        """Interned masks wider than 63 bits, by id (0: a free id)."""
        self._wide_ids: dict[int, int] = {}
        self._refs: list[int] = []
        self._free_ids: list[int] = []
        self._allocate(_MIN_SIZE)

    def _set_multiplier(self, multiplier: int) -> None:
        """The odd number codes are scrambled with (its inverse undoes it)."""
        self._multiplier = multiplier
        self._np_multiplier = np.uint64(multiplier)
        self._inverse = pow(multiplier, -1, 1 << 64)

    def _allocate(self, size: int) -> None:
        self._codes = array("Q", (0,)) * size
        self._values = array("Q", (0,)) * size
        self._size = size
        self._shift = 65 - size.bit_length()
        self._np_shift = np.uint64(self._shift)
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def slot_views(self) -> tuple[np.ndarray, np.ndarray]:
        """(codes, masks) as u64 numpy arrays sharing the table's memory (for compiled loops)."""
        return np.frombuffer(self._codes, dtype=np.uint64), np.frombuffer(self._values, dtype=np.uint64)

    def max_live(self) -> int:
        """Blocks past which an insert doubles the table first."""
        return int(_MAX_LOAD * self._size)

    def shrink_if_sparse(self) -> None:
        """After removals: a table less than an eighth full is rebuilt at half its load limit."""
        if self._size > _MIN_SIZE and self._live < self._size // 8:
            self._rebuild(2 * self._live)

    def nbytes(self) -> int:
        """Bytes of the slot arrays (the interned wide masks are not counted)."""
        return 16 * self._size

    def code(self, own_key: int) -> int:
        """The block's key in this table (and in the index's alias tables): nonzero, secret-scrambled."""
        return ((own_key + 1) * self._multiplier) & _U64

    def codes(self, own_keys: Sequence[int] | np.ndarray) -> list[int] | np.ndarray:
        """``code`` of each own key, which must be in [0, 2**63): the other methods trust codes made here. A u64
        array (an ingest process's note) gives a u64 array, computed without a Python int per key."""
        if isinstance(own_keys, np.ndarray) and own_keys.dtype == np.uint64:
            if len(own_keys) and int(own_keys.max()) >= KEY_LIMIT:
                raise ValueError("own keys are in [0, 2**63)")
            with np.errstate(over="ignore"):
                return (own_keys + np.uint64(1)) * np.uint64(self._multiplier)
        if len(own_keys) and not 0 <= min(own_keys) <= max(own_keys) < KEY_LIMIT:
            raise ValueError("own keys are in [0, 2**63)")
        multiplier = self._multiplier
        return [((own_key + 1) * multiplier) & _U64 for own_key in own_keys]

    def own_key(self, code: int) -> int:
        return ((code * self._inverse) & _U64) - 1

    def own_keys(self, codes: np.ndarray) -> np.ndarray:
        """``own_key`` of a u64 array of codes."""
        with np.errstate(over="ignore"):
            return codes * np.uint64(self._inverse) - np.uint64(1)

    def _encode(self, mask: int, count: int) -> int:
        """The word that stores ``mask`` for ``count`` more blocks."""
        if mask < WIDE:
            return mask
        wid = self._wide_ids.get(mask)
        if wid is None:
            if self._free_ids:
                wid = self._free_ids.pop()
                self._wide[wid] = mask
            else:
                wid = len(self._wide)
                self._wide.append(mask)
                self._refs.append(0)
            self._wide_ids[mask] = wid
        self._refs[wid] += count
        return WIDE | wid

    def _release(self, value: int, count: int) -> None:
        """``count`` blocks no longer store the word ``value``."""
        if value >= WIDE:
            wid = value ^ WIDE
            self._refs[wid] -= count
            if not self._refs[wid]:
                del self._wide_ids[self._wide[wid]]
                self._wide[wid] = 0
                self._free_ids.append(wid)

    def _decode(self, value: int) -> int:
        return value if value < WIDE else self._wide[value ^ WIDE]

    def _find(self, code: int) -> int:
        """The slot holding ``code``, or the empty slot where it would go."""
        codes, last = self._codes, self._size - 1
        slot = code >> self._shift
        current = codes[slot]
        while current != code and current:
            slot = (slot + 1) & last
            current = codes[slot]
        return slot

    def get(self, code: int) -> int:
        """The block's mask (0: no holder has it)."""
        return self._decode(self._values[self._find(code)])

    def set(self, code: int, mask: int) -> None:
        """Give the block this mask; 0 removes it."""
        if not 0 < code <= _U64 or mask < 0:
            raise ValueError("codes are nonzero u64 and masks are not negative")
        slot = self._find(code)
        old = self._values[slot]
        if not self._codes[slot]:
            if mask:
                self.add_absent([code], mask)
        elif not mask:
            self.remove_equal([code], self._decode(old))
        else:
            self._values[slot] = self._encode(mask, 1)
            self._release(old, 1)

    def add_absent(self, codes: Sequence[int], mask: int) -> list[int]:
        """Give ``mask`` to each block no holder has, in order; returns the codes of the others (blocks some
        holder had, or given ``mask`` earlier in this call), in order. One call per stored run."""
        if self._live + len(codes) > self.max_live():
            self._rebuild(self._live + len(codes))
        value = self._encode(mask, 0)
        table, values, last, shift = self._codes, self._values, self._size - 1, self._shift
        held: list[int] = []
        for code in codes:
            slot = code >> shift
            current = table[slot]
            while current != code and current:
                slot = (slot + 1) & last
                current = table[slot]
            if current:
                held.append(code)
            else:
                table[slot] = code
                values[slot] = value
        added = len(codes) - len(held)
        self._live += added
        self._encode(mask, added)
        self._release(value, 0)
        return held

    def remove_equal(self, codes: Sequence[int | None], mask: int) -> list[int]:
        """Remove every block whose mask is exactly ``mask`` (its last copy, for a one-bit mask); returns the
        other codes in order, for the caller's general path. None entries (what an alias table's
        ``pop_many`` gives for hashes it did not hold) are skipped.

        A removed slot is emptied and each later entry of its run that may live there shifts back into it
        (no tombstones): on the realistic mix about half the removals find the next slot occupied, and
        the back-shift is most of a removal's cost here (one without it cost 0.44-0.63 us against 1.0-1.1
        with it), paid so that the table never needs a sweep. The probe is inlined as in ``add_absent``."""
        if mask >= WIDE and mask not in self._wide_ids:
            return [code for code in codes if code is not None]  # no block has this mask
        value = mask if mask < WIDE else WIDE | self._wide_ids[mask]
        if None in codes:
            codes = [code for code in codes if code is not None]
        table, values, last, shift = self._codes, self._values, self._size - 1, self._shift
        others: list[int] = []
        for code in codes:
            hole = code >> shift
            current = table[hole]
            while current != code and current:
                hole = (hole + 1) & last
                current = table[hole]
            if not current or values[hole] != value:
                others.append(code)
                continue
            slot = (hole + 1) & last
            current = table[slot]
            while current:
                if (slot - (current >> shift)) & last >= (slot - hole) & last:
                    table[hole] = current
                    values[hole] = values[slot]
                    hole = slot
                slot = (slot + 1) & last
                current = table[slot]
            table[hole] = 0
            values[hole] = 0
        removed = len(codes) - len(others)
        if removed:
            self._live -= removed
            self._release(value, removed)
            self.shrink_if_sparse()
        return others

    def prefix_drops(self, own_keys: Sequence[int], wanted: int) -> list[tuple[int, int]]:
        """Routing's longest-prefix walk over a prompt's chain: (depth, holders of ``wanted`` that hold the
        chain's first ``depth`` blocks and not the next), in order; holders of the whole chain come last
        at ``len(own_keys)``.

        The chain is read in parts of growing length (``_FIRST_PART``, then sixteen times more each time), so a
        prompt whose prefix no candidate holds costs a few probes. Long parts are walked by compiled code for
        holders in slots 0-62 (a 2,048-block hit: 0.19-0.21 ms, 0.37-0.41 with the numpy passes it replaced);
        short parts and wider masks in Python."""
        drops: list[tuple[int, int]] = []
        alive, start, part = wanted, 0, _FIRST_PART
        while alive and start < len(own_keys):
            if len(own_keys) - start < 2 * part:
                part = len(own_keys) - start  # the rest in one pass rather than a short last one
            keys = own_keys[start : start + part]
            if alive < WIDE and len(keys) >= _COMPILED_MIN:
                rows, walked, left = _walk_compiled(*self.slot_views(), self._np_shift, self._np_multiplier,
                                                    np.array(keys, dtype=np.uint64), start, np.uint64(alive),
                                                    _DEPTHS, _DROPPED)
                drops.extend(zip(_DEPTHS[:rows].tolist(), _DROPPED[:rows].tolist(), strict=True))
                alive = int(left)
                if alive and walked < len(keys):  # an interned wide mask: the rest of the part in Python
                    alive = self._walk(keys[walked:], start + walked, alive, drops)
            else:
                alive = self._walk(keys, start, alive, drops)
            start += part
            part *= 16
        if alive:
            drops.append((len(own_keys), alive))
        return drops

    def _walk(self, own_keys: Sequence[int], start: int, alive: int, drops: list[tuple[int, int]]) -> int:
        """``prefix_drops`` over one part, probing each key in Python (any mask width); returns the holders
        still alive."""
        table, values, last, shift = self._codes, self._values, self._size - 1, self._shift
        multiplier = self._multiplier
        for depth, own_key in enumerate(own_keys, start):
            code = ((own_key + 1) * multiplier) & _U64
            slot = code >> shift
            current = table[slot]
            while current != code and current:
                slot = (slot + 1) & last
                current = table[slot]
            mask = values[slot]
            if mask >= WIDE:
                mask = self._wide[mask ^ WIDE]
            dropped = alive & ~mask
            if dropped:
                drops.append((depth, dropped))
                alive &= mask
                if not alive:
                    break
        return alive

    def needs_room(self, blocks: int) -> bool:
        """Whether ``blocks`` more would pass the load limit, so that an insert would double the table first."""
        return self._live + blocks > self.max_live()

    def regrown(self, entries: int) -> Regrown:
        """The live entries re-placed in the smallest power-of-two table that ``entries`` fill to at most
        ``_MAX_LOAD``, all at once with numpy (``placements``). It only reads this table, so it
        may run in a worker thread while the event loop reads the table too (never while it writes it)."""
        codes = np.frombuffer(self._codes, dtype=np.uint64)
        live = np.flatnonzero(codes)
        live_codes, live_values = codes[live], np.frombuffer(self._values, dtype=np.uint64)[live]
        del codes
        size = _MIN_SIZE
        while entries > _MAX_LOAD * size:
            size *= 2
        regrown = Regrown(size, array("Q", (0,)) * size, array("Q", (0,)) * size, len(live))
        order, places = placements((live_codes >> np.uint64(65 - size.bit_length())).astype(np.int64), size)
        np.frombuffer(regrown.codes, dtype=np.uint64)[places] = live_codes[order]
        np.frombuffer(regrown.values, dtype=np.uint64)[places] = live_values[order]
        return regrown

    def adopt(self, regrown: Regrown) -> None:
        """Take a table ``regrown`` built from this one's current entries."""
        self._codes, self._values = regrown.codes, regrown.values
        self._size = regrown.size
        self._shift = 65 - regrown.size.bit_length()
        self._np_shift = np.uint64(self._shift)
        self._live = regrown.live

    def _rebuild(self, entries: int) -> None:
        self.adopt(self.regrown(entries))


def placements(homes: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(entry order, slot of each entry in that order) where inserting entries one by one with circular
    linear probing from ``homes`` in a table of ``size`` empty slots would put them.

    Which slots linear probing fills does not depend on the order of insertion, so the entries are placed all at
    once: sorted by home, entry i goes to ``max(home_i, place_{i-1} + 1)``, a running maximum. The table is
    circular, so the run starts just after a slot that stays empty: past the table's end the m overflowing
    entries wrap into the first m free slots, so the (m+1)-th free slot of the unwrapped placement is free in the
    real one. Every entry then finds all slots between its home and its place occupied, as lookups expect."""
    order, places = _placed(homes)
    overflow = int((places >= size).sum())
    if overflow:
        free = np.ones(size, dtype=bool)
        free[places[places < size]] = False
        start = int(np.flatnonzero(free)[overflow]) + 1
        order, places = _placed((homes - start) % size)
        places = (places + start) % size
    return order, places


def _placed(homes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Linear probing without wrap-around, at once: (entry order, slot of each entry in that order)."""
    order = np.argsort(homes, kind="stable")
    rank = np.arange(len(homes))
    return order, rank + np.maximum.accumulate(homes[order] - rank)
