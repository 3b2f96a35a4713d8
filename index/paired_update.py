"""The index's commonest updates as compiled loops over an engine's alias table and the mask table.

A stored block new to its engine enters the alias table (engine hash -> code) and, new to the index, the
mask table (code -> holder mask); an evicted block leaves both. Each table has its own bulk loop in Python
(``AliasTable.put_many``/``pop_many``, ``MaskTable.add_absent``/``remove_equal``); here one iteration per block
does both probes, on the same words and with the same placement and back-shift rules as the tables' own
methods (the tables' tests and the index's model test hold them to one answer). A block another engine holds
too (a prompt every engine computes, a hot prefix's replica) only gains or loses the holder's bit in its mask,
with the engines' unique-block counts moved: ``add_bit_to_held`` and ``drop_bit_from_shared``.

The loops are compiled with numba: in Python each block cost about 3 us of probing (a multiply and words
read out of arrays as Python ints), most of a block op's ingest CPU; compiled, the call's fixed cost and
the conversion of its lists to arrays remain. The tables' words are ``array('Q')`` buffers that numpy views
without copying, so the Python methods and these loops share them.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

import numpy as np

from index.alias_table import AliasTable
from index.alias_words import TOMBSTONE, alias_home
from index.compiled import compiled
from index.mask_table import WIDE, MaskTable, mask_slot

_KEY_LIMIT = 1 << 63
_NO_SKIP = np.zeros(0, dtype=np.uint8)


@compiled
def alias_put(words, size, multiplier, engine_hash, value):
    """Set one alias in an alias table's words (``AliasTable.put_many``'s probe and placement, for one pair):
    returns (whether the hash had an alias, its previous value, 1 if a never-used slot was taken)."""
    end = 2 * size
    stored = engine_hash + np.uint64(1)
    at = alias_home(stored, multiplier, np.uint64(size))
    reusable = -1
    current = words[at]
    while current != stored and current != 0:
        if current == TOMBSTONE and reusable < 0:
            reusable = at
        at = at + 2 if at + 2 < end else 0
        current = words[at]
    if current != 0:
        before = words[at + 1]
        words[at + 1] = value
        return True, before, 0
    used = 0
    if reusable < 0:
        reusable = at
        used = 1
    words[reusable] = stored
    words[reusable + 1] = value
    return False, np.uint64(0), used


@compiled
def _store_loop(words, size, multiplier, table, values, shift, engine_hashes, codes, value, held, replaced):
    """The loop of ``store_new``; returns (held blocks, replaced aliases, newly used alias slots) and fills
    ``held`` and ``replaced`` (rows of code, previous code) in order."""
    last = np.int64(table.shape[0] - 1)
    n_held = n_replaced = used = 0
    for i in range(engine_hashes.shape[0]):
        code = codes[i]
        existed, before, taken = alias_put(words, size, multiplier, engine_hashes[i], code)
        if existed:
            replaced[n_replaced, 0] = code
            replaced[n_replaced, 1] = before
            n_replaced += 1
            continue
        used += taken
        slot = mask_slot(table, shift, last, code)
        if table[slot] != 0:
            held[n_held] = code
            n_held += 1
        else:
            table[slot] = code
            values[slot] = value
    return n_held, n_replaced, used


@compiled
def pop_loop(words, size, multiplier, engine_hashes, codes):
    """``AliasTable.pop_many`` over hashes already range-checked, keeping only the popped codes: fills
    ``codes`` in order and returns how many."""
    end = 2 * size
    one = np.uint64(1)
    usize = np.uint64(size)
    popped = 0
    for i in range(engine_hashes.shape[0]):
        stored = engine_hashes[i] + one
        at = alias_home(stored, multiplier, usize)
        current = words[at]
        while current != stored and current != 0:
            at = at + 2 if at + 2 < end else 0
            current = words[at]
        if current != 0:
            codes[popped] = words[at + 1]
            popped += 1
            words[at] = TOMBSTONE
            words[at + 1] = 0
    return popped


@compiled
def _remove_loop(table, values, shift, codes, skip, value, others):
    """``MaskTable.remove_equal`` of ``codes`` whose ``skip`` flag is 0 (``skip`` may be empty: none set);
    the rest go to ``others`` unchanged. Fills ``others`` in order; returns (blocks removed, others)."""
    last = np.int64(table.shape[0] - 1)
    gone = n_others = 0
    for i in range(codes.shape[0]):
        code = codes[i]
        if skip.shape[0] and skip[i]:
            others[n_others] = code
            n_others += 1
            continue
        hole = mask_slot(table, shift, last, code)
        if table[hole] == 0 or values[hole] != value:
            others[n_others] = code
            n_others += 1
            continue
        gone += 1
        slot = (hole + 1) & last
        current = table[slot]
        while current != 0:
            if ((slot - np.int64(current >> shift)) & last) >= ((slot - hole) & last):
                table[hole] = current
                values[hole] = values[slot]
                hole = slot
            slot = (slot + 1) & last
            current = table[slot]
        table[hole] = 0
        values[hole] = 0
    return gone, n_others


def _checked_hashes(engine_hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Engine hashes as the u64 array the loops read, each checked to be in [0, 2**63) (an alias key)."""
    if isinstance(engine_hashes, np.ndarray) and engine_hashes.dtype == np.uint64:
        if len(engine_hashes) and int(engine_hashes.max()) >= _KEY_LIMIT:
            raise ValueError("alias out of range: keys in [0, 2**63), values in [0, 2**64)")
        return engine_hashes
    if len(engine_hashes) and not (min(engine_hashes) >= 0 and max(engine_hashes) < _KEY_LIMIT):
        raise ValueError("alias out of range: keys in [0, 2**63), values in [0, 2**64)")
    return np.array(engine_hashes, dtype=np.uint64)


def store_new(aliases: AliasTable, masks: MaskTable, engine_hashes: Sequence[int] | np.ndarray,
              codes: Sequence[int] | np.ndarray, value: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``aliases.put_many(engine_hashes, codes)``, and each block whose alias is new and that no holder has
    gets the mask word ``value`` (< 2**63). Returns the codes of blocks with a new alias that some holder had
    (or that got ``value`` earlier in this call), in order, as a u64 array (``add_bit_to_held`` reads it), and
    (code, previous code) of the aliases that existed, in order: the caller's general path."""
    hashes = _checked_hashes(engine_hashes)
    count = len(hashes)
    if len(codes) != count:
        raise ValueError("one code per engine hash")
    if aliases._used + count > aliases.max_used():
        aliases._rebuild(count)
    if masks._live + count > masks.max_live():
        masks._rebuild(masks._live + count)
    held = np.empty(count, dtype=np.uint64)
    replaced = np.empty((count, 2), dtype=np.uint64)
    n_held, n_replaced, used = _store_loop(
        aliases.word_view(), aliases._size, np.uint64(aliases._multiplier), *masks.slot_views(),
        np.uint64(masks._shift), hashes, np.asarray(codes, dtype=np.uint64),
        np.uint64(value), held, replaced)
    added = count - n_replaced
    aliases._live += added
    aliases._used += used
    masks._live += added - n_held
    return held[:n_held], [(code, before) for code, before in replaced[:n_replaced].tolist()]


@compiled
def _lowest_slot(mask):
    """The slot of a nonzero mask's lowest bit (exact: a power of two below 2**64 is exact in a float)."""
    return np.int64(np.log2(np.float64(mask & (~mask + np.uint64(1)))) + 0.5)


@compiled
def _rebit_loop(table, values, shift, codes, bit, adding, wide, group_masks, unique_moves, again, general):
    """``add_bit_to_held``'s loop (``adding``) or ``drop_bit_from_shared``'s; returns (codes for ``again``, codes for
    ``general``) and fills both in order."""
    last = np.int64(table.shape[0] - 1)
    zero = np.uint64(0)
    n_again = n_general = 0
    for i in range(codes.shape[0]):
        code = codes[i]
        slot = mask_slot(table, shift, last, code)
        value = values[slot]
        if table[slot] == 0 or value >= wide:
            general[n_general] = code
            n_general += 1
            continue
        if adding and value & bit:
            again[n_again] = code
            n_again += 1
            continue
        new = value | bit if adding else value & ~bit
        if new == zero:  # the block leaves the table: the general path back-shifts
            general[n_general] = code
            n_general += 1
            continue
        values[slot] = new
        if value != zero:
            low = _lowest_slot(value)
            if value & ~group_masks[low] == zero:  # one engine held every copy: it may not any more
                unique_moves[low] -= 1
        low = _lowest_slot(new)
        if new & ~group_masks[low] == zero:
            unique_moves[low] += 1
    return n_again, n_general


def _rebit(masks: MaskTable, codes: np.ndarray, bit: int, adding: bool, group_masks: np.ndarray
           ) -> tuple[np.ndarray, list[int], list[int]]:
    again = np.empty(len(codes), dtype=np.uint64)
    general = np.empty(len(codes), dtype=np.uint64)
    unique_moves = np.zeros(64, dtype=np.int64)
    n_again, n_general = _rebit_loop(*masks.slot_views(), np.uint64(masks._shift), codes, np.uint64(bit), adding,
                                     np.uint64(WIDE), group_masks, unique_moves, again, general)
    return unique_moves, again[:n_again].tolist(), general[:n_general].tolist()


def add_bit_to_held(masks: MaskTable, codes: np.ndarray, bit: int, group_masks: np.ndarray
                    ) -> tuple[np.ndarray, list[int], list[int]]:
    """Give holder ``bit`` (< 2**63) to blocks some holder already has (``store_new``'s held codes), in one
    compiled loop: a block stored by a second engine (a system prompt every engine computes, a hot prefix's
    replica) cost about 3 us in Python per block (``PrefixIndex._add_bit``). ``group_masks[s]`` is the mask of
    the holders of slot ``s``'s engine (its data-parallel ranks): a block whose every copy one engine holds
    counts among that engine's unique blocks. Returns, per slot, how many unique blocks the engine of that slot
    gained (negative: lost), counted at the slot of a mask's lowest bit (a caller adds them up per engine); the
    codes whose holder had ``bit`` already (another alias of the block: the caller counts it), in order; and
    the codes left to the caller's general path (wide masks), in order."""
    return _rebit(masks, codes, bit, True, group_masks)


def drop_bit_from_shared(masks: MaskTable, codes: np.ndarray, bit: int, group_masks: np.ndarray
                         ) -> tuple[np.ndarray, list[int]]:
    """Take holder ``bit`` (< 2**63) from blocks other holders keep (``remove_sole``'s others that the holder
    has under no other alias), in one compiled loop: evicting a replicated block cost about 3 us in Python
    (``PrefixIndex._drop_bit``). Returns the unique blocks moved per slot (as ``add_bit_to_held``) and the codes
    left to the general path (wide masks, and a block whose mask the bit emptied), in order."""
    unique_moves, _, general = _rebit(masks, codes, bit, False, group_masks)
    return unique_moves, general


def remove_sole(aliases: AliasTable, masks: MaskTable, engine_hashes: Iterable[int] | np.ndarray, value: int,
                holder_slot: int, extra: Container[tuple[int, int]]) -> tuple[int, list[int]]:
    """``aliases.pop_many(engine_hashes)``, and each popped block whose mask word is exactly ``value``
    (< 2**63: its last copy, for a one-bit mask) leaves the mask table with the back-shift of
    ``MaskTable.remove_equal``, unless ``(holder_slot, code)`` is in ``extra`` (the holder has the block under
    another alias too). Returns how many aliases were popped and the other popped codes, in order (a u64 array)."""
    if isinstance(engine_hashes, np.ndarray) and engine_hashes.dtype == np.uint64:
        keys = engine_hashes[engine_hashes < _KEY_LIMIT]
    else:
        keys = np.array([key for key in engine_hashes if 0 <= key < _KEY_LIMIT], dtype=np.uint64)
    codes = np.empty(len(keys), dtype=np.uint64)
    popped = pop_loop(aliases.word_view(), aliases._size, np.uint64(aliases._multiplier), keys, codes)
    codes = codes[:popped]
    skip = np.array([(holder_slot, code) in extra for code in codes.tolist()], dtype=np.uint8) if extra else _NO_SKIP
    others = np.empty(popped, dtype=np.uint64)
    gone, n_others = _remove_loop(*masks.slot_views(), np.uint64(masks._shift), codes, skip, np.uint64(value), others)
    aliases._live -= popped
    aliases.shrink_if_sparse()
    if gone:
        masks._live -= gone
        masks.shrink_if_sparse()
    return popped, others[:n_others]


def remove_equal_sole(masks: MaskTable, codes: np.ndarray, value: int) -> list[int]:
    """``masks.remove_equal(codes, value)`` for a mask word ``value`` < 2**63, in the compiled loop: an engine's
    whole block set leaving at once (``AllBlocksCleared``, a restart) took 88 ms on the event loop for 65k
    blocks in Python (``kvmesh bench scale``). Returns the codes whose mask was not ``value``, in order."""
    others = np.empty(len(codes), dtype=np.uint64)
    gone, n_others = _remove_loop(*masks.slot_views(), np.uint64(masks._shift), codes, _NO_SKIP, np.uint64(value),
                                  others)
    if gone:
        masks._live -= gone
        masks.shrink_if_sparse()
    return others[:n_others].tolist()
