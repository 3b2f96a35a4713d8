"""The KV-cache events the index applies, as values: what a decoded vLLM event batch holds.

They live with the index (events/decode.py turns frames into them), so the index never imports the
code that reads sockets and frames: events depend on the index, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    unknown_events: int = 0
