"""The KV-cache events the index applies, as values: what a decoded vLLM event batch holds.

They live with the index (events/decode.py turns frames into them), so the index never imports the
code that reads sockets and frames: events depend on the index, never the reverse.

They are frozen msgspec structs, not frozen dataclasses: a frozen dataclass sets each field through
``object.__setattr__``, and building a decode event's ``BlockStored`` cost 4.9 us against 0.28 here (one
per stored event, one per batch): decoding the realistic mix went from 1.71 to 1.35 us per block op. They
hold no cycles, so the collector does not track them.
"""

from __future__ import annotations

from typing import Any

import msgspec


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    seq: int
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    unknown_events: int = 0
