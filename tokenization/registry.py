"""Which tokenizer serves which model, loaded once per process and checked for segment independence.

A tokenizer is named by a spec: a local HF folder or a hub name, loaded with ``AutoTokenizer`` the way
vLLM loads it (truncation on the left). ``HF_HUB_OFFLINE`` is honoured, so a router never reaches out
to the hub when told not to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenization.bounds import fewest_tokens, splits_at_whitespace
from tokenization.messages import RenderError
from tokenization.render import render_chat
from tokenization.segments import SegmentPlan, plan

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parent / "default"
"""The embedded byte-level BPE with a ChatML template that the simulated engines use."""

PROBE_CONVERSATIONS = (
    [{"role": "system", "content": "You are terse. "}, {"role": "user", "content": " hi\n"}],
    [{"role": "user", "content": "é😀\n\n  x"}, {"role": "assistant", "content": "ok  "},
     {"role": "user", "content": ""}],
    [{"role": "user", "content": [{"type": "text", "text": "def f():\n    return 1\n"},
                                  {"type": "text", "text": "\t"}]}],
)


def encodes_on_the_calling_thread() -> None:
    """Turn the Rust tokenizer's thread pool off for this process, unless ``TOKENIZERS_PARALLELISM`` says otherwise.

    With it on, a batch encode of several texts (a prompt's uncached segments) spreads them over pool threads and
    waits for them, and on the event loop that call holds the GIL: the loop waits for threads the OS may not run
    at once on a busy machine. In the opening burst of seed 0 suite shape #11 (nine new conversations, the router
    on a core of its own), a sibling's encode of a new system prompt's rest on the loop held it 33.5 and 35.4 ms
    in two runs; with the pool off no step of that burst held it over 17 ms. Every encode of the router and the
    simulated engines is a prompt's few segments or one long text, which the pool does not speed up here."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@lru_cache(maxsize=16)
def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """Load (once per process) the HF tokenizer named by ``spec``."""
    return AutoTokenizer.from_pretrained(spec, truncation_side="left", local_files_only=hub_offline())


def encode_plain(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], in_thread: bool = False) -> list[list[int]]:
    """Ids of each text without added special tokens: how every segment is tokenized.

    A fast tokenizer's Rust backend is called directly: the same ids as the HF call (tested). On the
    event loop (or in a worker process) without character offsets, 0.22 ms instead of 0.33 ms for a
    300-token turn on the way to the first token; ``in_thread``, through the call that releases the GIL
    (the offset-free one holds it: an 8k-token encode in a thread stalled the loop for 6 ms)."""
    if not texts:
        return []
    backend = plain_backend(tokenizer)
    if backend is None:
        out = tokenizer(list(texts), add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False)["input_ids"]
        return [list(ids) for ids in out]
    encode = backend.encode_batch if in_thread else backend.encode_batch_fast
    return [encoding.ids for encoding in encode(list(texts), add_special_tokens=False)]


@lru_cache(maxsize=16)
def plain_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """A private copy of a fast tokenizer's Rust backend with truncation and padding off (the HF call
    turns them off per call; a tokenizer.json may switch them on), or None for a slow tokenizer."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or not hasattr(backend, "encode_batch_fast"):
        return None
    own = Tokenizer.from_str(backend.to_str())
    own.no_truncation()
    own.no_padding()
    return own


def _rendered_probes(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    texts = []
    for messages in PROBE_CONVERSATIONS:
        try:
            texts.append(render_chat(tokenizer, {"messages": messages}))
        except RenderError:
            break
    return texts


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer ready for the router: the HF object and its checked segment plan."""

    spec: str
    hf: PreTrainedTokenizerBase
    plan: SegmentPlan
    longest_token: int
    """Characters in the longest vocabulary entry (see ``tokenization.bounds``)."""
    splits_words: bool
    """No token spans two whitespace-separated words (see ``tokenization.bounds``)."""

    def fewest_tokens(self, texts: Sequence[str], above: int) -> int:
        """A lower bound on the tokens of ``texts`` joined into one prompt, without encoding them."""
        return fewest_tokens(texts, self.longest_token, self.splits_words, above)

    @classmethod
    def load(cls, spec: str) -> LoadedTokenizer:
        hf = load_tokenizer(spec)
        added = [token.content for token in hf.added_tokens_decoder.values()]
        checked = plan(added, lambda texts: encode_plain(hf, texts),
                       lambda text: hf.encode(text, add_special_tokens=True), _rendered_probes(hf))
        return cls(spec, hf, checked, max(map(len, hf.get_vocab()), default=1), splits_at_whitespace(hf))


class TokenizerRegistry:
    """Maps served model names to tokenizer specs; unknown models use the default spec if one is set."""

    def __init__(self, models: Mapping[str, str] | None = None, default: str | None = None) -> None:
        self.models = dict(models or {})
        self.default = default

    def spec_for(self, model: object) -> str:
        spec = self.models.get(model) if isinstance(model, str) else None
        if spec is None:
            spec = self.default
        if spec is None:
            raise RenderError(f"The model `{model}` does not exist.", "model")
        return spec

    def specs(self) -> list[str]:
        """Every distinct spec, so that workers can load them before traffic arrives."""
        found = dict.fromkeys(self.models.values())
        if self.default is not None:
            found[self.default] = None
        return list(found)
