"""Serialize KV-cache event batches exactly as vLLM's msgspec encoder does (sans-IO).

A batch is the msgpack array `[ts, events, data_parallel_rank]`. Events are tagged maps
(`{"type": ..., fields...}`, vLLM >= ~0.26) or legacy tagged arrays (`["BlockStored", ...]`).
Fields without a default are always present; hashes are u64 unless raw 32-byte hashes are asked for
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
"""

from __future__ import annotations

from typing import Any, Literal

import msgpack

from index.vllm_hash import to_u64
from sim.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

Encoding = Literal["map", "array"]
SPEC_KIND = "full_attention"


def _h(block_hash: bytes, int_hashes: bool) -> int | bytes:
    return to_u64(block_hash) if int_hashes else block_hash


def event_fields(event: KVEvent, int_hashes: bool = True) -> tuple[str, list[tuple[str, Any]]]:
    """The event's tag and its (field, value) pairs in vLLM's declaration order."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return "BlockStored", [
            ("block_hashes", [_h(h, int_hashes) for h in event.block_hashes]),
            ("parent_block_hash", None if parent is None else _h(parent, int_hashes)),
            ("token_ids", event.token_ids),
            ("block_size", event.block_size),
            ("lora_id", None if event.lora is None else event.lora.id),
            ("medium", event.medium),
            ("lora_name", None if event.lora is None else event.lora.name),
            ("extra_keys", event.extra_keys),
            ("group_idx", 0),
            ("kv_cache_spec_kind", SPEC_KIND),
        ]
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", [
            ("block_hashes", [_h(h, int_hashes) for h in event.block_hashes]),
            ("medium", event.medium),
            ("group_idx", 0),
        ]
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared", []
    raise TypeError(f"not a KV event: {event!r}")


def encode_event(event: KVEvent, encoding: Encoding = "map", int_hashes: bool = True) -> Any:
    tag, fields = event_fields(event, int_hashes)
    if encoding == "map":
        out: dict[str, Any] = {"type": tag}
        out.update(fields)
        return out
    return [tag, *(v for _, v in fields)]


def encode_batch(
    ts: float, events: list[KVEvent], encoding: Encoding = "map", dp_rank: int = 0, int_hashes: bool = True
) -> bytes:
    """The third frame of a live message (and the payload of a replayed one)."""
    return msgpack.packb([ts, [encode_event(e, encoding, int_hashes) for e in events], dp_rank])
