"""The simulated engine's optional CPU tier, as vLLM's offloading connector keeps one (sans-IO).

What the router can see is kept from vLLM (``OffloadingConnector`` with ``self_describing_kv_events``):
- every block the engine computes is stored in the tier too (write-through, so a block the GPU cache evicts
  is already there), once: a block already in the tier is only marked recently used;
- the tier is LRU over its capacity; each block it drops is one ``BlockRemoved`` with ``medium`` "CPU";
- a store is announced as ``BlockStored`` with ``medium`` "CPU" and the same engine hashes, parent, token
  ids and extra keys as the GPU event (one event per run of newly stored blocks);
- a request whose prompt continues past its GPU prefix hit in the tier loads those blocks instead of
  computing them; the load takes ``bytes per block / bandwidth`` of engine time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sim.kv_cache import Adapter, BlockRemoved, KVEvent, stored_run

MEDIUM_CPU = "CPU"


@dataclass(slots=True)
class CpuTier:
    capacity_blocks: int
    block_load_s: float
    """Seconds to copy one block back into the GPU cache."""
    _blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1 or self.block_load_s < 0:
            raise ValueError("a CPU tier needs capacity_blocks >= 1 and block_load_s >= 0")

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[bytes], start: int, end: int) -> int:
        """How many of ``hashes[start:end]`` the tier holds without a gap (no side effects)."""
        count = 0
        for h in hashes[start:end]:
            if h not in self._blocks:
                break
            count += 1
        return count

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Loaded blocks were read: they are the tier's most recently used."""
        for h in hashes:
            self._blocks.move_to_end(h)

    def store(self, hashes: Sequence[bytes], start: int, end: int, token_ids: Sequence[int], block_size: int,
              extra_keys: Sequence[tuple[Any, ...] | None], lora: Adapter | None = None) -> list[KVEvent]:
        """Offload blocks ``start..end-1`` of a sequence (``token_ids``/``extra_keys`` cover all of it)."""
        events: list[KVEvent] = []
        run: list[int] = []
        for i in range(start, end):
            if hashes[i] in self._blocks:
                self._blocks.move_to_end(hashes[i])
                self._announce(run, hashes, token_ids, block_size, extra_keys, lora, events)
                run = []
                continue
            while len(self._blocks) >= self.capacity_blocks:
                evicted, _ = self._blocks.popitem(last=False)
                events.append(BlockRemoved([evicted], medium=MEDIUM_CPU))
            self._blocks[hashes[i]] = None
            run.append(i)
        self._announce(run, hashes, token_ids, block_size, extra_keys, lora, events)
        return events

    @staticmethod
    def _announce(run: list[int], hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int,
                  extra_keys: Sequence[tuple[Any, ...] | None], lora: Adapter | None, events: list[KVEvent]) -> None:
        if not run:
            return
        events.append(stored_run(hashes, run[0], run[-1] + 1, token_ids, block_size, extra_keys, lora, MEDIUM_CPU))

