"""The index's two commonest updates as one loop over an engine's alias table and the mask table.

A stored block new to its engine enters the alias table (engine hash -> code) and, new to the index, the
mask table (code -> holder mask); an evicted block leaves both. Each table has its own bulk loop
(``AliasTable.put_many``/``pop_many``, ``MaskTable.add_absent``/``remove_equal``); run one after the other
they pass every block twice through Python and build a list of codes between them. Here one iteration per
block does both probes, on the same words and with the same placement and back-shift rules as the tables'
own methods (the tables' tests and the index's model test hold them to one answer).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence

from index.alias_table import AliasTable
from index.mask_table import MaskTable

_U64 = (1 << 64) - 1
_KEY_LIMIT = 1 << 63
_TOMBSTONE = _U64


def store_new(aliases: AliasTable, masks: MaskTable, engine_hashes: Sequence[int], codes: Sequence[int],
              value: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``aliases.put_many(engine_hashes, codes)``, and each block whose alias is new and that no holder has
    gets the mask word ``value`` (< 2**63). Returns the codes of blocks with a new alias that some holder had
    (or that got ``value`` earlier in this call), in order, and (code, previous code) of the aliases that
    existed, in order: the caller's general path."""
    if engine_hashes and not (min(engine_hashes) >= 0 and max(engine_hashes) < _KEY_LIMIT):
        raise ValueError("alias out of range: keys in [0, 2**63), values in [0, 2**64)")
    count = len(engine_hashes)
    if aliases._used + count > aliases.max_used():
        aliases._rebuild(count)
    if masks._live + count > masks.max_live():
        masks._rebuild(masks._live + count)
    words, size, multiplier = aliases._words, aliases._size, aliases._multiplier
    end = 2 * size
    table, values, last, shift = masks._codes, masks._values, masks._size - 1, masks._shift
    held: list[int] = []
    replaced: list[tuple[int, int]] = []
    used = 0
    for key, code in zip(engine_hashes, codes, strict=True):
        stored = key + 1
        at = 2 * ((((stored * multiplier) & _U64) >> 32) * size >> 32)
        reusable = -1
        current = words[at]
        while current != stored and current:
            if current == _TOMBSTONE and reusable < 0:
                reusable = at
            at = at + 2 if at + 2 < end else 0
            current = words[at]
        if current:
            replaced.append((code, words[at + 1]))
            words[at + 1] = code
            continue
        if reusable < 0:
            reusable = at
            used += 1
        words[reusable] = stored
        words[reusable + 1] = code
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
    added = count - len(replaced)
    aliases._live += added
    aliases._used += used
    masks._live += added - len(held)
    return held, replaced


def remove_sole(aliases: AliasTable, masks: MaskTable, engine_hashes: Iterable[int], value: int,
                holder_slot: int, extra: Container[tuple[int, int]]) -> tuple[int, list[int]]:
    """``aliases.pop_many(engine_hashes)``, and each popped block whose mask word is exactly ``value``
    (< 2**63: its last copy, for a one-bit mask) leaves the mask table with the back-shift of
    ``MaskTable.remove_equal``, unless ``(holder_slot, code)`` is in ``extra`` (the holder has the block under
    another alias too). Returns how many aliases were popped and the other popped codes, in order."""
    words, size, multiplier = aliases._words, aliases._size, aliases._multiplier
    end = 2 * size
    table, values, last, shift = masks._codes, masks._values, masks._size - 1, masks._shift
    others: list[int] = []
    popped = gone = 0
    for key in engine_hashes:
        if not 0 <= key < _KEY_LIMIT:
            continue
        stored = key + 1
        at = 2 * ((((stored * multiplier) & _U64) >> 32) * size >> 32)
        current = words[at]
        while current != stored and current:
            at = at + 2 if at + 2 < end else 0
            current = words[at]
        if not current:
            continue
        code = words[at + 1]
        words[at] = _TOMBSTONE
        words[at + 1] = 0
        popped += 1
        if extra and (holder_slot, code) in extra:
            others.append(code)
            continue
        hole = code >> shift
        current = table[hole]
        while current != code and current:
            hole = (hole + 1) & last
            current = table[hole]
        if not current or values[hole] != value:
            others.append(code)
            continue
        gone += 1
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
    aliases._live -= popped
    aliases.shrink_if_sparse()
    if gone:
        masks._live -= gone
        masks.shrink_if_sparse()
    return popped, others
