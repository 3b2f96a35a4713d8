"""The simulated engine's tokenizer: vLLM's rendering (tokenization/render.py, the same code the router
uses, proved equal to real vLLM by the vllm tests) plus the token table used to make generated text.

Repeated prompts (benchmarks, shared documents) are served from a bounded cache: every engine of a sim
process shares one core, and encoding dominates a simulated request's CPU.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from tokenization.registry import DEFAULT_TOKENIZER_DIR
from tokenization.render import Kind, prompt_token_ids_sync

CACHE_ENTRIES = 4096


class SimTokenizer:
    """A loaded tokenizer plus the token table used to make generated text."""

    def __init__(self, path: str | Path = DEFAULT_TOKENIZER_DIR) -> None:
        self.path = str(path)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        special = set(self.tok.all_special_ids)
        self.token_text = [self.tok.decode([i]) for i in range(len(self.tok))]
        self.gen_vocab = [
            i
            for i, t in enumerate(self.token_text)
            if i not in special and t and "\ufffd" not in t and t.isprintable()
        ]
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    def prompt_ids(self, body: dict[str, Any], kind: Kind, placeholders: Mapping[str, str] | None = None
                   ) -> list[int]:
        """The ids vLLM computes for this request before media expansion (raises tokenization's RenderError
        for a 400); ``placeholders`` name the media the model takes."""
        key = kind + repr(sorted((placeholders or {}).items())) + json.dumps(body, sort_keys=True, default=str)
        ids = self._cache.get(key)
        if ids is None:
            ids = self._cache[key] = prompt_token_ids_sync(self.tok, body, kind, placeholders)
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.token_text[i] for i in token_ids)
