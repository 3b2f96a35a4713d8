"""vLLM v1's exact prefix-cache block hash (sha256 over pickle protocol 5).

Shared by the simulated engine (which must publish the same hashes as vLLM) and by verification
code. The router's own index does not depend on it (see docs/vllm.md): it exists so that engine hashes
can be reproduced and checked byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Any

from index.media_keys import MediaSpan, block_media

DEFAULT_SEED = "vllm-none-hash"
U64_MASK = (1 << 64) - 1


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's `sha256` hash function: sha256 over pickle protocol 5."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def resolve_seed(seed: str | None = None) -> str:
    """The NONE_HASH seed: explicit value, else PYTHONHASHSEED, else vLLM's fixed default."""
    if seed is not None:
        return seed
    return os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)


def none_hash(seed: str | None = None) -> bytes:
    """The parent hash of a chain's first block."""
    return sha256_pickle(resolve_seed(seed))


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None) -> bytes:
    """One block's 32-byte hash, chained on its parent (NONE_HASH for the first block)."""
    return sha256_pickle((parent, tuple(token_ids), extra_keys))


LoraKey = tuple[str, str]
"""A LoRA adapter as it enters block keys: (name, path)."""


def salt_extra_keys(block_index: int, cache_salt: str | None, lora: LoraKey | None = None,
                    media: tuple[tuple[str, int], ...] = ()) -> tuple[Any, ...] | None:
    """What BlockStored's ``extra_keys`` carries: the adapter's bare name on every block of an adapter
    request, the block's multimodal ``(identifier, offset)`` pairs (``index.media_keys``), then block 0's bare
    salt; an empty salt counts as none. (Salt checked against a real engine; the order from vLLM's
    ``generate_block_hash_extra_keys``: LoRA, multimodal, salt.)"""
    keys: tuple[Any, ...] = (() if lora is None else (lora[0],)) + media
    if block_index == 0 and cache_salt:
        keys += (cache_salt,)
    return keys or None


def salt_hash_keys(block_index: int, cache_salt: str | None, lora: LoraKey | None = None,
                   media: tuple[tuple[str, int], ...] = ()) -> tuple[Any, ...] | None:
    """What a block's hash is computed over: ``("lora", name, path)`` for an adapter request, ``("mm",
    identifier, offset)`` per item in the block, then block 0's tagged ``("cache_salt", salt)``, although the
    event publishes them untagged (real engine, vLLM 0.32 CPU: the published hashes of salted blocks match
    this recipe and not the untagged one)."""
    keys: tuple[Any, ...] = (() if lora is None else (("lora", *lora),)) + tuple(("mm", *pair) for pair in media)
    if block_index == 0 and cache_salt:
        keys += (("cache_salt", cache_salt),)
    return keys or None


def to_u64(block_hash: bytes) -> int:
    """The value vLLM publishes in KV events (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(block_hash, "big") & U64_MASK


class BlockHasher:
    """Incremental chained hashing of one token sequence's full blocks.

    Requests grow by generated tokens; hashing only the newly completed blocks keeps the cost
    proportional to new tokens instead of the whole sequence.
    """

    __slots__ = ("block_size", "cache_salt", "hashes", "lora", "media", "_root")

    def __init__(self, block_size: int, cache_salt: str | None = None, seed: str | None = None,
                 lora: LoraKey | None = None, media: tuple[MediaSpan, ...] = ()) -> None:
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.lora = lora
        self.media = media
        self.hashes: list[bytes] = []
        self._root = none_hash(seed)

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        """Hash every full block of `token_ids` not hashed yet; return the new hashes."""
        bs = self.block_size
        new: list[bytes] = []
        start = len(self.hashes) * bs
        while start + bs <= len(token_ids):
            index = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else self._root
            pairs = block_media(self.media, index, bs) if self.media else ()
            h = hash_block(parent, token_ids[start : start + bs],
                           salt_hash_keys(index, self.cache_salt, self.lora, pairs))
            self.hashes.append(h)
            new.append(h)
            start += bs
        return new


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, seed: str | None = None
) -> list[bytes]:
    """All full-block hashes of a token sequence."""
    return BlockHasher(block_size, cache_salt, seed).extend(token_ids)
