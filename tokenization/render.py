"""Render and tokenize OpenAI request bodies exactly as vLLM's OpenAI server does (sans-IO, sync).

Chat: parse messages (see ``messages.py``), apply the tokenizer's chat template to text with the
request's template arguments, then encode the text with ``add_special_tokens`` (default False: the
template already wrote them). Completions: a string is encoded with ``add_special_tokens`` (default
True), a list of ints is used as is, a list of either is a batch. ``truncate_prompt_tokens`` keeps the
last N tokens, as vLLM's tokenizers truncate on the left.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import jinja2.meta
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from tokenization.messages import RenderError, conversation, detect_content_format

Kind = Literal["chat", "completion"]
Encoder = Callable[[str, bool], list[int]]

REJECTED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})


@dataclass(frozen=True)
class TextPrompt:
    """A prompt still to be encoded: the text, whether special tokens are added, and truncation."""

    text: str
    add_special_tokens: bool
    truncate: int | None = None
    keep_left: bool = False


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt the client sent as token ids."""

    ids: list[int]
    truncate: int | None = None
    keep_left: bool = False


Prompt = TextPrompt | TokenPrompt


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RenderError(f"'{key}' must be a boolean.", key)
    return value


def _truncation(body: dict[str, Any]) -> tuple[int | None, bool]:
    """``truncate_prompt_tokens`` (-1 means the model length, unknown here: no truncation) and side."""
    limit = body.get("truncate_prompt_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < -1):
        raise RenderError("'truncate_prompt_tokens' must be an integer >= -1.", "truncate_prompt_tokens")
    side = body.get("truncation_side") or "left"
    if side not in ("left", "right"):
        raise RenderError("'truncation_side' must be 'left' or 'right'.", "truncation_side")
    return (None if limit in (None, -1) else limit), side == "right"


@lru_cache(maxsize=64)
def _template_variables(chat_template: str) -> frozenset[str]:
    env = _compile_jinja_template(chat_template).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(chat_template)))


@lru_cache(maxsize=8)
def _apply_parameters(cls: type) -> frozenset[str]:
    """Named parameters of ``apply_chat_template``: vLLM always lets these through."""
    params = inspect.signature(cls.apply_chat_template).parameters.values()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _template_kwargs(tokenizer: PreTrainedTokenizerBase, template: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ChatParams: request kwargs under the explicit fields, filtered to what the template uses."""
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, dict):
        raise RenderError("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    if unexpected := REJECTED_TEMPLATE_KWARGS & user.keys():
        raise RenderError(f"Found unexpected chat template kwargs from request: {sorted(unexpected)}",
                          "chat_template_kwargs")
    explicit = {
        "add_generation_prompt": _flag(body, "add_generation_prompt", True),
        "continue_final_message": _flag(body, "continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": body.get("reasoning_effort"),
    }
    if explicit["add_generation_prompt"] and explicit["continue_final_message"]:
        raise RenderError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                          "continue_final_message")
    if body.get("reasoning_effort") is not None and "enable_thinking" not in user:
        explicit["enable_thinking"] = body["reasoning_effort"] != "none"
    merged = user | {k: v for k, v in explicit.items() if v is not None and v != "auto"}
    accepted = _template_variables(template) | _apply_parameters(type(tokenizer))
    return {k: v for k, v in merged.items() if k in accepted and k not in REJECTED_TEMPLATE_KWARGS}


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Tool definitions as vLLM's pydantic models dump them: missing optional fields become None."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise RenderError("`tools` must be a non-empty array.", "tools")
    dumped = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RenderError("Each tool needs a function with a string name.", "tools")
        dumped.append({
            "type": "function",
            "function": {"name": function["name"], "description": function.get("description"),
                         "parameters": function.get("parameters")},
        })
    return dumped


def render_chat(tokenizer: PreTrainedTokenizerBase, body: dict[str, Any],
                placeholders: Mapping[str, str] | None = None) -> str:
    """The prompt text vLLM renders for a ``/v1/chat/completions`` body; ``placeholders`` name the media the
    model takes (``tokenization.media``)."""
    if body.get("chat_template") is not None:
        raise RenderError("Chat template is passed with request, but --trust-request-chat-template is not "
                          "set. Refused request with untrusted chat template.", "chat_template")
    tools = _tools(body)
    try:
        template = tokenizer.get_chat_template(None, tools=tools)
    except ValueError as exc:
        raise RenderError(str(exc), "messages") from exc
    messages = conversation(body.get("messages"), detect_content_format(template), placeholders)
    kwargs = _template_kwargs(tokenizer, template, body)
    kwargs.pop("return_dict", None)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, return_dict=False, **kwargs)
    except Exception as exc:  # jinja raises anything the template author wrote: a 400, as in vLLM
        raise RenderError(str(exc), "messages") from exc
    if not isinstance(text, str):
        raise RenderError("The chat template did not render text.", "messages")
    return text


def _token_ids(value: Sequence[Any], vocab_size: int) -> list[int]:
    ids = list(value)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise RenderError(f"Token id {token!r} is out of vocabulary.", "prompt")
    return ids


def prompts(tokenizer: PreTrainedTokenizerBase, body: dict[str, Any], kind: Kind,
            placeholders: Mapping[str, str] | None = None) -> list[Prompt]:
    """The prompts of one request before encoding: one for chat, one or more for completions."""
    if not isinstance(body, dict):
        raise RenderError("The request body must be a JSON object.")
    truncate, keep_left = _truncation(body)
    if kind == "chat":
        return [TextPrompt(render_chat(tokenizer, body, placeholders), _flag(body, "add_special_tokens", False),
                           truncate, keep_left)]
    add_special = _flag(body, "add_special_tokens", True)
    raw = body.get("prompt")
    if raw is None:
        raise RenderError("Either prompt or prompt_embeds must be provided; this router needs 'prompt'.",
                          "prompt")
    if isinstance(raw, str):
        return [TextPrompt(raw, add_special, truncate, keep_left)]
    if not isinstance(raw, list) or not raw:
        raise RenderError("'prompt' must be a string, a list of strings, or token ids.", "prompt")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in raw):
        return [TokenPrompt(_token_ids(raw, len(tokenizer)), truncate, keep_left)]
    out: list[Prompt] = []
    for item in raw:
        if isinstance(item, str):
            out.append(TextPrompt(item, add_special, truncate, keep_left))
        elif isinstance(item, list) and item:
            out.append(TokenPrompt(_token_ids(item, len(tokenizer)), truncate, keep_left))
        else:
            raise RenderError("Each prompt in a batch must be a string or a non-empty list of token ids.",
                              "prompt")
    return out


def truncated(ids: list[int], limit: int | None, keep_left: bool) -> list[int]:
    """Apply ``truncate_prompt_tokens`` to encoded ids: keep the last N (or the first N if ``keep_left``).

    vLLM truncates inside the HF tokenizer; for tokenizers that add a BOS token, HF keeps it while this
    slice drops it. No supported tokenizer adds one; the real-vLLM tests would show the difference.
    """
    if limit is None or len(ids) <= limit:
        return ids
    return ids[:limit] if keep_left else ids[len(ids) - limit:]


def finish(ids: list[int]) -> list[int]:
    """Reject an empty prompt, as the engine does."""
    if not ids:
        raise RenderError("The prompt cannot be empty.", "prompt")
    return ids


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids of one prompt with the tokenizer directly (the reference the cache must equal)."""
    if isinstance(prompt, TokenPrompt):
        ids = prompt.ids
    else:
        ids = tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
    return finish(truncated(ids, prompt.truncate, prompt.keep_left))


def all_prompt_token_ids_sync(tokenizer: PreTrainedTokenizerBase, body: dict[str, Any], kind: Kind,
                              placeholders: Mapping[str, str] | None = None) -> list[list[int]]:
    """Token ids of every prompt in the request (a completions batch has several)."""
    return [encode_prompt(tokenizer, prompt) for prompt in prompts(tokenizer, body, kind, placeholders)]


def prompt_token_ids_sync(tokenizer: PreTrainedTokenizerBase, body: dict[str, Any], kind: Kind,
                          placeholders: Mapping[str, str] | None = None) -> list[int]:
    """Token ids vLLM computes for the request (before media expansion); for a completions batch, those of
    the first prompt."""
    return all_prompt_token_ids_sync(tokenizer, body, kind, placeholders)[0]
