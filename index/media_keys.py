"""Multimodal items in block keys, laid out exactly as vLLM 0.32 lays them out.

vLLM expands each image or audio item of a prompt into a run of placeholder tokens and keys every block
that overlaps the run with the item's identifier and where the run starts relative to the block
(``kv_cache_utils._gen_mm_extra_hash_keys``): ``("mm", identifier, offset - block_start)`` in the hash,
``(identifier, offset - block_start)`` in the BlockStored event's ``extra_keys``, the offset negative in
blocks after the one where the item began. The identifier is the request's ``uuid`` for the item when it
sent one (vLLM's ``multi_modal_uuids``), else the engine's own content hash. The router sends its own
content hash as the uuid, so it knows the identifier the engine will publish and can key the blocks
itself: ``media_chain`` gives the same own keys that ingesting the engine's events gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from index.block_hash import chain, next_key

MediaPair = tuple[str, int]
"""An item's identifier and its start relative to a block's first token, as events publish it."""


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One item's run of placeholder tokens in the prompt (vLLM's ``PlaceholderRange``) and its identifier."""

    identifier: str
    offset: int
    length: int


def block_media(spans: Sequence[MediaSpan], block_index: int, block_size: int) -> tuple[MediaPair, ...]:
    """The items overlapping one block, in prompt order: every span that starts before the block ends and
    ends after it starts (spans are sorted and disjoint, as vLLM's are)."""
    start = block_index * block_size
    end = start + block_size
    return tuple((s.identifier, s.offset - start) for s in spans if s.offset < end and start < s.offset + s.length)


def packed_media(pairs: tuple[MediaPair, ...]) -> bytes | None:
    """The bytes ingest mixes into a block's own key for these pairs (``index.ingest.split_extra_keys``)."""
    return msgpack.packb([list(pair) for pair in pairs], use_bin_type=True) if pairs else None


def media_chain(token_ids: Sequence[int], block_size: int, seed: int, spans: Sequence[MediaSpan]) -> list[int]:
    """Own keys of every full block, with each block's items mixed in as ingest mixes the engine's."""
    if not spans:
        return chain(token_ids, block_size, seed)
    keys: list[int] = []
    parent = seed
    for i in range(len(token_ids) // block_size):
        extra = packed_media(block_media(spans, i, block_size))
        parent = next_key(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        keys.append(parent)
    return keys
