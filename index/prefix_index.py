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

# Interning only saves memory; bounding the table keeps many-engine churn from growing it forever.
_MAX_INTERNED = 4096


class PrefixIndex:
    """Exact block index fed by KV events; lookup is a longest-prefix walk over a block chain."""

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

    def _slot_of(self, engine: str) -> int:
        slot = self._slot.get(engine)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[engine] = slot
            self._slot_owner[slot] = engine
            self._aliases[engine] = AliasTable()
        return slot

    def _intern(self, mask: int) -> int:
        if len(self._interned) >= _MAX_INTERNED:
            self._interned.clear()
        return self._interned.setdefault(mask, mask)

    def _add_bit(self, own_key: int, bit: int, slot: int) -> None:
        mask = self._masks.get(own_key, 0)
        if mask & bit:
            pair = (slot, own_key)
            self._extra_aliases[pair] = self._extra_aliases.get(pair, 0) + 1
        else:
            self._masks[own_key] = self._intern(mask | bit)

    def _drop_bit(self, own_key: int, bit: int, slot: int) -> None:
        pair = (slot, own_key)
        extra = self._extra_aliases.get(pair)
        if extra:
            if extra == 1:
                del self._extra_aliases[pair]
            else:
                self._extra_aliases[pair] = extra - 1
            return
        mask = self._masks.get(own_key, 0) & ~bit
        if mask:
            self._masks[own_key] = self._intern(mask)
        else:
            self._masks.pop(own_key, None)

    def store(self, engine: str, pairs: Sequence[tuple[int, int]]) -> int:
        if not pairs:
            return 0
        slot = self._slot_of(engine)
        bit = 1 << slot
        aliases = self._aliases[engine]
        changed = 0
        for engine_hash, own_key in pairs:
            previous = aliases.get(engine_hash)
            if previous == own_key:
                continue
            if previous is not None:
                self._drop_bit(previous, bit, slot)
            aliases[engine_hash] = own_key
            self._add_bit(own_key, bit, slot)
            changed += 1
        return changed

    def remove(self, engine: str, engine_hashes: Iterable[int]) -> int:
        aliases = self._aliases.get(engine)
        if not aliases:
            return 0
        slot = self._slot[engine]
        bit = 1 << slot
        removed = 0
        for engine_hash in engine_hashes:
            own_key = aliases.pop(engine_hash, None)
            if own_key is not None:
                self._drop_bit(own_key, bit, slot)
                removed += 1
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
            mask = self._masks.get(own_key, 0) & ~bit
            if mask:
                self._masks[own_key] = self._intern(mask)
            else:
                self._masks.pop(own_key, None)
        self._extra_aliases = {pair: n for pair, n in self._extra_aliases.items() if pair[0] != slot}
        count = len(aliases)
        self._release(engine)
        return count

    def _release(self, engine: str) -> None:
        """Free an empty engine's slot so engine churn never grows the masks without bound."""
        slot = self._slot.pop(engine)
        del self._slot_owner[slot]
        del self._aliases[engine]
        self._free_slots.append(slot)
        if not self._slot:
            self._interned.clear()

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
