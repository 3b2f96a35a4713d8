"""Prompt rendering and tokenization as vLLM does it, with a Hugging Face tokenizer.

Chat: render the chat template to text (add_generation_prompt as requested), then encode without
special tokens; completions: encode with special tokens; a prompt of ints is used as token ids.
Repeated prompts (benchmarks, shared documents) are served from a bounded cache because encoding
holds the GIL and every engine of the process shares the core.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "tokenization" / "default"
CACHE_ENTRIES = 4096


class PromptError(ValueError):
    """The prompt cannot be rendered or tokenized (answered with 400)."""


def _flatten_content(content: Any) -> str:
    """vLLM's "string" content format: text parts joined with newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise PromptError("only text content parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise PromptError("message content must be a string or a list of content parts")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError("each message needs a string role")
        msg = dict(m)
        msg["content"] = _flatten_content(m.get("content"))
        out.append(msg)
    return out


class SimTokenizer:
    """A loaded tokenizer plus the token table used to make generated text."""

    def __init__(self, path: str | Path = DEFAULT_TOKENIZER) -> None:
        self.path = str(path)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        special = set(self.tok.all_special_ids)
        self.token_text = [self.tok.decode([i]) for i in range(len(self.tok))]
        self.gen_vocab = [
            i
            for i, t in enumerate(self.token_text)
            if i not in special and t and "\ufffd" not in t and t.isprintable()
        ]
        self._cache: OrderedDict[tuple[Any, ...], list[int]] = OrderedDict()

    def _cached(self, key: tuple[Any, ...], compute: Any) -> list[int]:
        ids = self._cache.get(key)
        if ids is None:
            ids = compute()
            self._cache[key] = ids
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return ids

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        try:
            return self.tok.apply_chat_template(
                normalize_messages(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            )
        except PromptError:
            raise
        except Exception as exc:
            raise PromptError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self._cached(("chat", text), lambda: self.tok.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self._cached(("text", prompt, add_special_tokens),
                                lambda: self.tok.encode(prompt, add_special_tokens=add_special_tokens))
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(0 <= t < len(self.token_text) for t in prompt):
                raise PromptError("token id out of vocabulary range")
            return list(prompt)
        raise PromptError("prompt must be a string or a non-empty list of token ids")

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.token_text[i] for i in token_ids)
