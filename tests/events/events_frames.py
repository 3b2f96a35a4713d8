"""Builders of vLLM KV-event wire frames per docs/vllm.md, shared by the events and index tests."""

from __future__ import annotations

from typing import Any

import msgpack


def stored_map(hashes: list[Any], parent: Any, tokens: list[int], block_size: int, *,
               lora_name: str | None = None, extra_keys: list[Any] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                             "token_ids": tokens, "block_size": block_size, "medium": "GPU"}
    if lora_name is not None:
        event["lora_name"] = lora_name
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    event["locality"] = "local"  # a newer field the decoder must ignore
    return event


def stored_array(hashes: list[Any], parent: Any, tokens: list[int], block_size: int, *,
                 lora_name: str | None = None, extra_keys: list[Any] | None = None) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, block_size, None, "GPU", lora_name, extra_keys, 0]


def removed_map(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def removed_array(hashes: list[Any]) -> list[Any]:
    return ["BlockRemoved", hashes, "GPU"]


def payload(events: list[Any], ts: float = 1.0, rank: int = 0) -> bytes:
    return msgpack.packb([ts, events, rank], use_bin_type=True)


def live_frames(seq: int, events: list[Any], topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload(events)]
