"""A simulated engine's KV connector over a shared folder, as vLLM's ExampleConnector (formerly
SharedStorageConnector) keys and finds a prompt's blocks: the opaque P/D protocol, where the router only
orders the legs and the cache moves on the connector's own channel.

What vLLM 0.32's ``ExampleConnector`` does, and this module with it:

- **Store.** A request the engine computes (it found nothing to load) is written once its prefill has run,
  under ``<shared_storage_path>/<md5 of the prompt's first align(len) token ids as int64 bytes, then the
  media identifiers joined by "-">``, where ``align(n) = (n - 1) // block_size * block_size``; a folder that
  exists already is not written again.
- **Find.** A new request looks for the folder of its first ``align(len - 1)`` tokens; when it exists the
  engine loads those tokens (less what it holds locally) instead of computing them, and counts them as
  external prefix-cache hits.
- Every engine running the connector does both, whatever its ``kv_role``; and the connector hands no
  ``kv_transfer_params`` over (its ``request_finished`` returns none), so such an engine plays no handoff.

The two alignments differ when ``len - 1`` is a multiple of the block size: the key stored covers one
block more than the key looked up, and vLLM's D misses (recomputes) such a prompt. The sim keeps that.

The folder holds an empty ``kv_cache`` file instead of one ``<layer>.safetensors`` per layer: only the
folder's existence decides a hit, in vLLM as here.
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from collections.abc import Sequence

from index.media_keys import MediaSpan

log = logging.getLogger(__name__)


def align_to_block_size(num_tokens: int, block_size: int) -> int:
    """ExampleConnector's alignment (one token short of whole blocks: the last prompt token is computed)."""
    return (num_tokens - 1) // block_size * block_size


class SharedStorage:
    """A shared folder of prompts' KV caches, keyed as ExampleConnector keys them."""

    def __init__(self, path: str, block_size: int) -> None:
        self.path = path
        self.block_size = block_size
        self.failed_saves = 0

    def _folder(self, token_ids: Sequence[int], media: Sequence[MediaSpan]) -> str:
        data = array("q", token_ids).tobytes()  # int64 in the machine's order, as torch's tensor.numpy()
        if media:
            data += "-".join(m.identifier for m in media).encode()
        return os.path.join(self.path, hashlib.md5(data, usedforsecurity=False).hexdigest())

    def matched_tokens(self, prompt_ids: Sequence[int], media: Sequence[MediaSpan]) -> int:
        """Leading prompt tokens the store holds (0 when it holds none): ExampleConnector's lookup."""
        n = align_to_block_size(len(prompt_ids) - 1, self.block_size)
        return n if n > 0 and os.path.isdir(self._folder(prompt_ids[:n], media)) else 0

    def save(self, prompt_ids: Sequence[int], media: Sequence[MediaSpan]) -> None:
        """Write a computed prompt's blocks, unless the store already holds them."""
        if self.matched_tokens(prompt_ids, media):
            return
        n = align_to_block_size(len(prompt_ids), self.block_size)
        if n <= 0:
            return
        folder = self._folder(prompt_ids[:n], media)
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "kv_cache"), "wb"):
                pass
        except OSError as exc:  # a full or read-only folder costs later requests their hits, not this one
            self.failed_saves += 1
            if self.failed_saves == 1:
                log.warning("cannot write the shared KV folder %s: %s", self.path, exc)
