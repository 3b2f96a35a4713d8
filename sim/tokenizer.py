"""The simulated engine's tokenizer: vLLM's rendering (tokenization/render.py, the same code the router
uses, proved equal to real vLLM by the vllm tests) plus the token table used to make generated text.

Every engine of a sim process shares one core, and encoding was most of a simulated request's CPU: on an agentic
suite shape (46 streams of growing histories on 11 engines) the sim process sat at a whole core, 60% of it in
encoding, so requests queued in its front end before any engine saw them, time no real engine's front end (one
per engine) adds. Repeated prompts are served whole from a bounded cache, and a prompt's text is encoded in
segments cut before added tokens (``tokenization/segments.py``: the message boundaries of a chat template), each
cached by its text, so a conversation's next turn encodes only its new messages. The tokenizer is checked for
segment independence when loaded, and the first segmented prompt and every ``CHECK_EVERY``-th after it are
also encoded whole: a mismatch turns segments off for good (logged), so the ids stay vLLM's whole-text ids.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenization.cache import TokenCache
from tokenization.registry import DEFAULT_TOKENIZER_DIR, LoadedTokenizer, encode_plain
from tokenization.render import Kind, Prompt, TextPrompt, encode_prompt, finish, prompts, truncated

log = logging.getLogger("kvmesh.sim")

CACHE_ENTRIES = 4096
SEGMENT_CACHE_TOKENS = 2_000_000
CHECK_EVERY = 16


class SimTokenizer:
    """A loaded tokenizer plus the token table used to make generated text."""

    def __init__(self, path: str | Path = DEFAULT_TOKENIZER_DIR) -> None:
        self.path = str(path)
        loaded = LoadedTokenizer.load(self.path)
        self.tok = loaded.hf
        self.plan = loaded.plan
        self.segmented = loaded.plan.segmentable
        """False once a segmented prompt's ids differed from its whole text's (or the load check failed)."""
        self.segments = TokenCache(SEGMENT_CACHE_TOKENS)
        self._until_check = 1
        """Segmented prompts until the next whole-text check: the first one, then every ``CHECK_EVERY``-th."""
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
        for a 400); ``placeholders`` name the media the model takes. For a completions batch, the first
        prompt's."""
        key = kind + repr(sorted((placeholders or {}).items())) + json.dumps(body, sort_keys=True, default=str)
        ids = self._cache.get(key)
        if ids is None:
            ids = self._cache[key] = [self._ids(prompt) for prompt in prompts(self.tok, body, kind, placeholders)][0]
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return ids

    def _ids(self, prompt: Prompt) -> list[int]:
        """One prompt's ids: a text prompt from its cached segments where the tokenizer allows it."""
        affixes = self.plan.affixes if isinstance(prompt, TextPrompt) and prompt.add_special_tokens else ((), ())
        if not isinstance(prompt, TextPrompt) or not self.segmented or affixes is None:
            return encode_prompt(self.tok, prompt)
        pieces = self.plan.split(prompt.text)
        found, misses = self.segments.look_up(self.path, pieces)
        joined = self.segments.joined(self.path, pieces, found, misses, encode_plain(self.tok, misses))
        ids = [*affixes[0], *joined, *affixes[1]]
        if len(pieces) > 1 and self._due_for_check():
            whole = self.tok.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
            if whole != ids:
                log.warning("segmented prompt ids differ from the whole text's: segments off for %s", self.path)
                self.segmented = False
                ids = whole
        return finish(truncated(ids, prompt.truncate, prompt.keep_left))

    def _due_for_check(self) -> bool:
        self._until_check -= 1
        if self._until_check > 0:
            return False
        self._until_check = CHECK_EVERY
        return True

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.token_text[i] for i in token_ids)
