"""BlockStore: per-engine alias tables plus one global own_key -> engine bitmask table.

Memory is what limits this structure. The alias tables (engine hash -> own key, only read when events
arrive) and the mask table (own key -> holder mask, read by routing for a whole prompt chain at once) are
packed u64 arrays, so a block costs no Python object. Engine sets are int bitmasks (one bit per engine
slot): a block held by any number of engines costs one mask-table slot.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from index.alias_table import AliasTable, RebuiltAliases
from index.holders import engine_of
from index.mask_table import WIDE, MaskTable, Regrown
from index.paired_update import add_bit_to_held, drop_bit_from_shared, remove_equal_sole, remove_sole, store_new

LARGE_ALIASES = 65_536
"""Alias tables of at least this many slots are rebuilt ahead of ingest; a smaller one's rebuild takes a few ms."""
WARM_CHAIN_BLOCKS = 64
"""A chain long enough that ``MaskTable.prefix_drops`` walks a part of it in compiled code."""


def _ints(values: Sequence[int] | np.ndarray) -> list[int]:
    """Python ints for the general (interned-mask) paths, which compute with them."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


@functools.cache
def load_compiled_loops() -> None:
    """Run each compiled loop (index/paired_update.py, ``MaskTable.prefix_drops``) once on throwaway tables, so
    that a process's first event and first lookup do not pay for loading them: 0.27-0.41 s of CPU from
    numba's cache on disk, 1.6-2.6 s when they are compiled (a fresh checkout's first run). The lookup walks a
    chain long enough for its compiled part (``MaskTable.prefix_drops`` walks short parts in Python): warmed with
    a two-block chain, a process's first lookup of a long prompt paid the walk's loading on the way to its first
    token: 6 ms from the cache, 0.27 s compiling in an exported tree, where the routing suite's revision routers
    decided one early request in 466-488 ms."""
    aliases, masks = AliasTable(), MaskTable()
    keys = list(range(1, WARM_CHAIN_BLOCKS + 1))
    store_new(aliases, masks, keys, masks.codes(keys), 1)
    shared = np.array(masks.codes(keys), dtype=np.uint64)
    add_bit_to_held(masks, shared, 2, np.full(64, 3, dtype=np.uint64))
    drop_bit_from_shared(masks, shared, 2, np.full(64, 3, dtype=np.uint64))
    masks.prefix_drops(keys, 1)
    remove_sole(aliases, masks, keys, 1, 0, {})


@dataclass(frozen=True, slots=True)
class Room:
    """Tables of an index rebuilt with room (``PrefixIndex.regrown``), ready to be adopted together."""

    masks: Regrown | None
    aliases: dict[str, RebuiltAliases]


class PrefixIndex:
    """Exact block index fed by KV events; lookup is a longest-prefix walk over a block chain.

    It also keeps, per engine (index/holders.py groups an engine's data-parallel ranks), how many blocks
    no other engine holds, updated with every change of a block's mask: counting them by a scan held the
    event loop 0.67 s at 2M indexed blocks."""

    def __init__(self) -> None:
        load_compiled_loops()
        self._aliases: dict[str, AliasTable] = {}
        self._slot: dict[str, int] = {}
        self._slot_owner: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._masks = MaskTable()
        # Rare case: one engine holding the same own key under two engine hashes (vLLM does not
        # de-duplicate identical blocks). Counting extra aliases keeps removals exact.
        self._extra_aliases: dict[tuple[int, int], int] = {}
        self._slot_group: dict[int, str] = {}
        """The engine each slot's holder belongs to."""
        self._group_mask: dict[str, int] = {}
        """Per engine, the slots of its holders."""
        self._slot_group_masks = np.zeros(64, dtype=np.uint64)
        """Per slot under 63, its engine's holder slots under 63 (what the compiled loops read of ``_group_mask``)."""
        self._unique: dict[str, int] = {}
        """Per engine, blocks whose every holder is one of its own."""
        self.writes = 0
        """Calls that changed (or may have changed) the tables: a table regrown meanwhile is stale."""

    def _slot_of(self, engine: str) -> int:
        slot = self._slot.get(engine)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[engine] = slot
            self._slot_owner[slot] = engine
            self._aliases[engine] = AliasTable()
            group = self._slot_group[slot] = engine_of(engine)
            self._group_mask[group] = self._group_mask.get(group, 0) | 1 << slot
            self._spread_group_mask(group)
        return slot

    def _spread_group_mask(self, group: str) -> None:
        """Copy ``group``'s holder mask to each of its narrow slots in ``_slot_group_masks`` (when a holder joins or
        leaves: a walk over the slots, not per block)."""
        narrow = self._group_mask.get(group, 0) & (WIDE - 1)
        for slot, owner in self._slot_group.items():
            if owner == group and slot < 63:
                self._slot_group_masks[slot] = narrow

    def _sole_group(self, mask: int) -> str | None:
        """The engine holding every copy of a block with this mask, if only one does."""
        if not mask:
            return None
        group = self._slot_group[(mask & -mask).bit_length() - 1]
        return group if not mask & ~self._group_mask[group] else None

    def _remask(self, code: int, old: int, new: int) -> None:
        """A block's mask changes from ``old`` to ``new``: store it and move its unique count."""
        self._masks.set(code, new)
        before, after = self._sole_group(old), self._sole_group(new)
        if before != after:
            unique = self._unique
            if before is not None:
                unique[before] = unique.get(before, 0) - 1
            if after is not None:
                unique[after] = unique.get(after, 0) + 1

    def _drop_bit(self, code: int, bit: int, slot: int) -> None:
        pair = (slot, code)
        extra = self._extra_aliases.get(pair)
        if extra:
            if extra == 1:
                del self._extra_aliases[pair]
            else:
                self._extra_aliases[pair] = extra - 1
            return
        mask = self._masks.get(code)
        self._remask(code, mask, mask & ~bit)

    def store(self, engine: str, pairs: Sequence[tuple[int, int]]) -> int:
        if not pairs:
            return 0
        return self.store_many(engine, [h for h, _ in pairs], [k for _, k in pairs])

    def store_many(self, engine: str, engine_hashes: Sequence[int] | np.ndarray,
                   own_keys: Sequence[int] | np.ndarray) -> int:
        """Record ``engine_hashes[i] -> own_keys[i]`` in order; returns how many aliases changed. Both may be
        u64 arrays (an ingest process's notes), which the compiled loops read without a Python int per block.

        The common case (engine hashes new to the engine, blocks new to the index) enters the alias table and
        the mask table in one loop (``_store_paired``); only blocks other engines hold and replaced aliases
        take the general path."""
        if not len(engine_hashes):
            return 0
        self.writes += 1
        codes = self._masks.codes(own_keys)
        slot = self._slot_of(engine)
        bit = 1 << slot
        if bit < WIDE:
            return self._store_paired(engine, engine_hashes, codes, bit, slot)
        engine_hashes, codes = _ints(engine_hashes), _ints(codes)
        group = self._slot_group[slot]
        previous = self._aliases[engine].put_many(engine_hashes, codes)
        if previous.count(None) == len(previous):
            return self._store_new_aliases(codes, bit, slot, group)
        fresh = changed = 0
        for code, before in zip(codes, previous, strict=True):
            if before != code:
                changed += 1
                fresh += self._realias(code, before, bit, slot)
        if fresh:
            self._unique[group] = self._unique.get(group, 0) + fresh
        return changed

    def _store_paired(self, engine: str, engine_hashes: Sequence[int] | np.ndarray, codes: list[int] | np.ndarray,
                      bit: int, slot: int) -> int:
        """``store_many`` for holder slots 0-62: aliases new to the engine and blocks new to the index take
        one loop over both tables (index/paired_update.py); blocks other holders had and replaced aliases
        follow. The general path's per-block order is not needed: a block's bit and extra aliases of one
        holder only count up and down."""
        held, replaced = store_new(self._aliases[engine], self._masks, engine_hashes, codes, bit)
        if len(held):
            self._add_bit_to_held(held, bit, slot)
        fresh = len(codes) - len(replaced) - len(held)
        changed = len(codes) - len(replaced)
        for code, before in replaced:
            if before != code:
                changed += 1
                fresh += self._realias(code, before, bit, slot)
        if fresh:
            group = self._slot_group[slot]
            self._unique[group] = self._unique.get(group, 0) + fresh
        return changed

    def _add_bit_to_held(self, held: np.ndarray, bit: int, slot: int) -> None:
        """``_add_bit`` of each code in ``held`` (blocks some holder has), in the compiled loop where masks are
        narrow."""
        unique_moves, again, general = add_bit_to_held(self._masks, held, bit, self._slot_group_masks)
        self._move_unique(unique_moves)
        extra = self._extra_aliases
        for code in again:
            pair = (slot, code)
            extra[pair] = extra.get(pair, 0) + 1
        for code in general:
            self._add_bit(code, bit, slot)

    def _drop_bit_from_shared(self, others: np.ndarray, bit: int, slot: int) -> None:
        """``_drop_bit`` of each code in ``others`` (``remove_sole``'s: blocks other holders keep, or the holder
        has under another alias), in the compiled loop where the holder has no other alias and masks are narrow."""
        extra = self._extra_aliases
        if extra:
            listed = others.tolist()
            twice = [(slot, code) in extra for code in listed]
            if any(twice):
                for code, held_twice in zip(listed, twice, strict=True):
                    if held_twice:
                        self._drop_bit(code, bit, slot)
                others = np.array([code for code, held_twice in zip(listed, twice, strict=True) if not held_twice],
                                  dtype=np.uint64)
        unique_moves, general = drop_bit_from_shared(self._masks, others, bit, self._slot_group_masks)
        self._move_unique(unique_moves)
        for code in general:
            self._drop_bit(code, bit, slot)

    def _move_unique(self, unique_moves: np.ndarray) -> None:
        """Apply the compiled loops' unique-block moves, counted per slot, to the engines those slots belong to."""
        moved: dict[str, int] = {}
        for low in np.flatnonzero(unique_moves).tolist():
            group = self._slot_group[low]
            moved[group] = moved.get(group, 0) + int(unique_moves[low])
        for group, count in moved.items():
            if count:
                self._unique[group] = self._unique.get(group, 0) + count

    def _realias(self, code: int, before: int | None, bit: int, slot: int) -> int:
        """One alias of the holder now names ``code`` instead of ``before`` (None: a new alias); returns 1 when
        the block is new to the index."""
        if before is not None:
            self._drop_bit(before, bit, slot)
        if self._masks.get(code):
            self._add_bit(code, bit, slot)
            return 0
        self._masks.set(code, bit)
        return 1

    def _store_new_aliases(self, codes: Sequence[int], bit: int, slot: int, group: str) -> int:
        """``store_many`` when every alias is new: blocks no engine holds get ``bit`` in one table call,
        then each block some holder had already gets ``bit`` added (or counts as an extra alias)."""
        held = self._masks.add_absent(codes, bit)
        for code in held:
            self._add_bit(code, bit, slot)
        fresh = len(codes) - len(held)
        if fresh:
            self._unique[group] = self._unique.get(group, 0) + fresh
        return len(codes)

    def _add_bit(self, code: int, bit: int, slot: int) -> None:
        """A block some holder has gains one: ``bit``, or another alias of it if the holder has it already."""
        mask = self._masks.get(code)
        if mask & bit:
            pair = (slot, code)
            self._extra_aliases[pair] = self._extra_aliases.get(pair, 0) + 1
        else:
            self._remask(code, mask, mask | bit)

    def remove(self, engine: str, engine_hashes: Iterable[int] | np.ndarray) -> int:
        aliases = self._aliases.get(engine)
        if not aliases:
            return 0
        self.writes += 1
        slot = self._slot[engine]
        bit = 1 << slot
        group = self._slot_group[slot]
        if bit >= WIDE:
            removed, gone = self._remove_general(aliases, _ints(engine_hashes), slot)
        else:
            # The common case, the last copy of a block, leaves both tables in one loop; a block the holder
            # also has under another alias loses that alias instead, in ``_drop_bit``.
            removed, others = remove_sole(aliases, self._masks, engine_hashes, bit, slot, self._extra_aliases)
            if len(others):
                self._drop_bit_from_shared(others, bit, slot)
            gone = removed - len(others)
        if gone:
            self._unique[group] = self._unique.get(group, 0) - gone
        if not aliases:
            self._release(engine)
        return removed

    def _remove_general(self, aliases: AliasTable, engine_hashes: Iterable[int], slot: int) -> tuple[int, int]:
        """``remove`` for a holder slot past 62 (interned masks): (aliases popped, blocks that left the index)."""
        bit = 1 << slot
        extra = self._extra_aliases
        codes = aliases.pop_many(engine_hashes)
        removed = len(codes) - codes.count(None)
        held_twice = [code for code in codes if code is not None and (slot, code) in extra] if extra else []
        if held_twice:
            codes = [code for code in codes if (slot, code) not in extra]
        others = self._masks.remove_equal(codes, bit)
        for code in held_twice + others:
            self._drop_bit(code, bit, slot)
        return removed, removed - len(held_twice) - len(others)

    def clear(self, engine: str) -> int:
        aliases = self._aliases.get(engine)
        if aliases is None:
            return 0
        self.writes += 1
        slot = self._slot[engine]
        bit = 1 << slot
        # Blocks only this holder had leave in one table call: per block through ``set``, clearing an engine
        # of 246k blocks held the loop 1.2 s (0.42 s with the table's Python loop; compiled for slots 0-62).
        if bit < WIDE:
            # A code the holder has under two aliases comes twice; its second copy is not found again and
            # joins ``others`` with its mask unchanged, which the loop below leaves as it is.
            codes = aliases.arrays()[1]
            others = remove_equal_sole(self._masks, codes, bit)
        else:
            codes = list(set(aliases.values()))
            others = self._masks.remove_equal(codes, bit)
        if len(others) < len(codes):
            group = self._slot_group[slot]
            self._unique[group] = self._unique.get(group, 0) - (len(codes) - len(others))
        for code in others:
            mask = self._masks.get(code)
            self._remask(code, mask, mask & ~bit)
        self._extra_aliases = {pair: n for pair, n in self._extra_aliases.items() if pair[0] != slot}
        count = len(aliases)
        self._release(engine)
        return count

    def _release(self, engine: str) -> None:
        """Free an empty engine's slot so engine churn never grows the masks without bound."""
        slot = self._slot.pop(engine)
        del self._slot_owner[slot]
        del self._aliases[engine]
        group = self._slot_group.pop(slot)
        group_mask = self._group_mask[group] & ~(1 << slot)
        if group_mask:
            self._group_mask[group] = group_mask
        else:
            del self._group_mask[group]
            self._unique.pop(group, None)
        if slot < 63:
            self._slot_group_masks[slot] = 0
        self._spread_group_mask(group)
        self._free_slots.append(slot)

    def __len__(self) -> int:
        """Distinct blocks in the index (one however many holders have it)."""
        return len(self._masks)

    def needs_room(self, blocks: int, holders: Iterable[str] = ()) -> bool:
        """Whether storing ``blocks`` new blocks would double the mask table inside the store call, or the
        next stores of ``holders`` could rebuild a large alias table of theirs (sweeping its tombstones): at
        a million blocks the doubling held the caller 0.16-0.26 s, at 262k blocks an engine's sweep 66-97
        ms (``events/index_room.py`` does both ahead, in a worker thread)."""
        return self._masks.needs_room(blocks) or any(True for _ in self._crowded(holders))

    def _crowded(self, holders: Iterable[str]) -> Iterator[tuple[str, AliasTable]]:
        """Large alias tables of ``holders`` that a sixteenth of their size in inserts could make rebuild."""
        for holder in holders:
            aliases = self._aliases.get(holder)
            if aliases is not None and aliases.rebuilds_soon(LARGE_ALIASES):
                yield holder, aliases

    def regrown(self, blocks: int, holders: Iterable[str] = ()) -> Room:
        """The tables ``needs_room`` names, rebuilt with room; only reads the index (see ``MaskTable.regrown``
        and ``AliasTable.rebuilt``), so it may run in a worker thread."""
        masks = self._masks.regrown(len(self._masks) + blocks) if self._masks.needs_room(blocks) else None
        return Room(masks, {holder: aliases.rebuilt() for holder, aliases in list(self._crowded(holders))})

    def adopt(self, room: Room, writes: int) -> bool:
        """Take ``room`` if the index was not written since ``writes`` was read (before it was built)."""
        if writes != self.writes:
            return False
        if room.masks is not None:
            self._masks.adopt(room.masks)
        for holder, rebuilt in room.aliases.items():
            self._aliases[holder].adopt(rebuilt)
        return True

    def unique_blocks(self) -> dict[str, int]:
        """Per engine (its data-parallel ranks together), how many blocks no other engine holds."""
        return {group: count for group, count in self._unique.items() if count}

    def own_key(self, engine: str, engine_hash: int) -> int | None:
        code = None if (aliases := self._aliases.get(engine)) is None else aliases.get(engine_hash)
        return None if code is None else self._masks.own_key(code)

    def holds(self, engine: str, own_key: int) -> bool:
        slot = self._slot.get(engine)
        return slot is not None and bool(self._masks.get(self._masks.code(own_key)) >> slot & 1)

    def overlap(self, chain: Sequence[int], engines: Iterable[str] | None = None) -> dict[str, int]:
        if engines is None:
            wanted = (1 << (max(self._slot.values()) + 1)) - 1 if self._slot else 0
        else:
            wanted = 0
            for engine in engines:
                slot = self._slot.get(engine)
                if slot is not None:
                    wanted |= 1 << slot
        result: dict[str, int] = {}
        for depth, dropped in self._masks.prefix_drops(chain, wanted):
            self._record(result, dropped, depth)
        return result

    def _record(self, result: dict[str, int], slots_mask: int, depth: int) -> None:
        if depth == 0:
            return
        owner = self._slot_owner
        while slots_mask:
            low = slots_mask & -slots_mask
            result[owner[low.bit_length() - 1]] = depth
            slots_mask ^= low

    def block_count(self, engine: str) -> int:
        aliases = self._aliases.get(engine)
        return 0 if aliases is None else len(aliases)

    def engines(self) -> list[str]:
        return sorted(self._aliases)

    def export(self, engine: str) -> tuple[np.ndarray, np.ndarray]:
        """One engine's (engine hashes, own keys) as u64 arrays: what a starting replica is sent."""
        aliases = self._aliases.get(engine)
        if aliases is None:
            empty = np.zeros(0, dtype=np.uint64)
            return empty, empty.copy()
        engine_hashes, codes = aliases.arrays()
        return engine_hashes, self._masks.own_keys(codes)

    def pairs(self, engine: str) -> dict[int, int]:
        """A copy of one engine's alias map (what a replica snapshots or replicates)."""
        aliases = self._aliases.get(engine)
        own_key = self._masks.own_key
        return {} if aliases is None else {h: own_key(code) for h, code in aliases.items()}
