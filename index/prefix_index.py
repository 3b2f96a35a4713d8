"""BlockStore: per-engine alias tables plus one global own_key -> engine bitmask dict.

Memory is what limits this structure. The alias tables (engine hash -> own key, only read when events
arrive) are packed u64 arrays; the lookup side is a dict, since routing walks it once per prompt block.
Engine sets are int bitmasks (one bit per engine slot) and masks are interned, so a block held by any
number of engines costs one dict entry, one own-key int and a shared mask.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from index.alias_table import AliasTable
from index.holders import engine_of

# Interning only saves memory; bounding the table keeps many-engine churn from growing it forever.
_MAX_INTERNED = 4096


class PrefixIndex:
    """Exact block index fed by KV events; lookup is a longest-prefix walk over a block chain.

    It also keeps, per engine (index/holders.py groups an engine's data-parallel ranks), how many blocks
    no other engine holds, updated with every change of a block's mask: counting them by a scan held the
    event loop 0.67 s at 2M indexed blocks."""

    def __init__(self) -> None:
        self._aliases: dict[str, AliasTable] = {}
        self._slot: dict[str, int] = {}
        self._slot_owner: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._masks: dict[int, int] = {}
        self._interned: dict[int, int] = {}
        # Rare case: one engine holding the same own key under two engine hashes (vLLM does not
        # de-duplicate identical blocks). Counting extra aliases keeps removals exact.
        self._extra_aliases: dict[tuple[int, int], int] = {}
        self._slot_group: dict[int, str] = {}
        """The engine each slot's holder belongs to."""
        self._group_mask: dict[str, int] = {}
        """Per engine, the slots of its holders."""
        self._unique: dict[str, int] = {}
        """Per engine, blocks whose every holder is one of its own."""

    def _slot_of(self, engine: str) -> int:
        slot = self._slot.get(engine)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[engine] = slot
            self._slot_owner[slot] = engine
            self._aliases[engine] = AliasTable()
            group = self._slot_group[slot] = engine_of(engine)
            self._group_mask[group] = self._group_mask.get(group, 0) | 1 << slot
        return slot

    def _intern(self, mask: int) -> int:
        if len(self._interned) >= _MAX_INTERNED:
            self._interned.clear()
        return self._interned.setdefault(mask, mask)

    def _sole_group(self, mask: int) -> str | None:
        """The engine holding every copy of a block with this mask, if only one does."""
        if not mask:
            return None
        group = self._slot_group[(mask & -mask).bit_length() - 1]
        return group if not mask & ~self._group_mask[group] else None

    def _remask(self, own_key: int, old: int, new: int) -> None:
        """A block's mask changes from ``old`` to ``new``: store it and move its unique count."""
        if new:
            self._masks[own_key] = self._intern(new)
        else:
            self._masks.pop(own_key, None)
        before, after = self._sole_group(old), self._sole_group(new)
        if before != after:
            unique = self._unique
            if before is not None:
                unique[before] = unique.get(before, 0) - 1
            if after is not None:
                unique[after] = unique.get(after, 0) + 1

    def _drop_bit(self, own_key: int, bit: int, slot: int) -> None:
        pair = (slot, own_key)
        extra = self._extra_aliases.get(pair)
        if extra:
            if extra == 1:
                del self._extra_aliases[pair]
            else:
                self._extra_aliases[pair] = extra - 1
            return
        mask = self._masks.get(own_key, 0)
        self._remask(own_key, mask, mask & ~bit)

    def store(self, engine: str, pairs: Sequence[tuple[int, int]]) -> int:
        if not pairs:
            return 0
        return self.store_many(engine, [h for h, _ in pairs], [k for _, k in pairs])

    def store_many(self, engine: str, engine_hashes: Sequence[int], own_keys: Sequence[int]) -> int:
        """Record ``engine_hashes[i] -> own_keys[i]`` in order; returns how many aliases changed.

        The common case (a block new to the index) is handled inline with the slot's own bit object: the
        general path per block cost about twice as much."""
        if not engine_hashes:
            return 0
        slot = self._slot_of(engine)
        bit = self._intern(1 << slot)
        group = self._slot_group[slot]
        previous = self._aliases[engine].put_many(engine_hashes, own_keys)
        masks = self._masks
        fresh = changed = 0
        for own_key, before in zip(own_keys, previous, strict=True):
            if before == own_key:
                continue
            changed += 1
            if before is not None:
                self._drop_bit(before, bit, slot)
            mask = masks.get(own_key)
            if mask is None:
                masks[own_key] = bit
                fresh += 1
            elif mask & bit:
                pair = (slot, own_key)
                self._extra_aliases[pair] = self._extra_aliases.get(pair, 0) + 1
            else:
                self._remask(own_key, mask, mask | bit)
        if fresh:
            self._unique[group] = self._unique.get(group, 0) + fresh
        return changed

    def remove(self, engine: str, engine_hashes: Iterable[int]) -> int:
        aliases = self._aliases.get(engine)
        if not aliases:
            return 0
        slot = self._slot[engine]
        bit = 1 << slot
        group = self._slot_group[slot]
        masks, extra = self._masks, self._extra_aliases
        removed = gone = 0
        for own_key in aliases.pop_many(engine_hashes):
            if own_key is None:
                continue
            removed += 1
            if masks.get(own_key) == bit and not (extra and (slot, own_key) in extra):
                del masks[own_key]  # the common case: the last copy of the block
                gone += 1
            else:
                self._drop_bit(own_key, bit, slot)
        if gone:
            self._unique[group] = self._unique.get(group, 0) - gone
        if not aliases:
            self._release(engine)
        return removed

    def clear(self, engine: str) -> int:
        aliases = self._aliases.get(engine)
        if aliases is None:
            return 0
        slot = self._slot[engine]
        bit = 1 << slot
        for own_key in set(aliases.values()):
            mask = self._masks.get(own_key, 0)
            self._remask(own_key, mask, mask & ~bit)
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
        self._free_slots.append(slot)
        if not self._slot:
            self._interned.clear()

    def unique_blocks(self) -> dict[str, int]:
        """Per engine (its data-parallel ranks together), how many blocks no other engine holds."""
        return {group: count for group, count in self._unique.items() if count}

    def own_key(self, engine: str, engine_hash: int) -> int | None:
        aliases = self._aliases.get(engine)
        return None if aliases is None else aliases.get(engine_hash)

    def holds(self, engine: str, own_key: int) -> bool:
        slot = self._slot.get(engine)
        return slot is not None and bool(self._masks.get(own_key, 0) >> slot & 1)

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
        alive = wanted
        get = self._masks.get
        for depth, key in enumerate(chain):
            mask = get(key, 0)
            dropped = alive & ~mask
            if dropped:
                self._record(result, dropped, depth)
                alive &= mask
                if not alive:
                    return result
        self._record(result, alive, len(chain))
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
        return aliases.arrays()

    def pairs(self, engine: str) -> dict[int, int]:
        """A copy of one engine's alias map (what a replica snapshots or replicates)."""
        aliases = self._aliases.get(engine)
        return {} if aliases is None else dict(aliases.items())
