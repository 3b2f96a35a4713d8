"""Continue a streamed answer on another engine when its engine breaks mid-stream (sans-IO).

The client has already received the response head and some tokens, so a failure cannot be retried the
usual way. Instead the router asks another engine to go on from the text generated so far (chat: the
messages plus that text as a final assistant message, with vLLM's ``continue_final_message``; completions:
the prompt followed by the text) and splices the new stream into the client's: the same ``id``,
``created`` and ``model`` in every chunk, one ``finish_reason``, one usage chunk counting every token the
client received against the original prompt. The continuation is not token-identical to what the broken
engine would have produced: sampling restarts, and the text may re-tokenize differently.

``StreamSplicer`` parses the SSE stream incrementally (chunk boundaries anywhere) and decides what the
client gets; ``continuation_body`` builds the next engine's request. The I/O is in ``gateway.proxy``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.request_body import Kind

MAX_CONTINUATIONS = 2
"""Continuations per request; past that, a broken stream ends with an SSE error event as before."""
DONE = b"data: [DONE]\n\n"
_TEXT = re.compile(rb'"(?:content|text)":\s*"([^"\\]*(?:\\.[^"\\]*)*)"')
_KEYS = re.compile(rb'"(finish_reason|usage|error|tool_calls|reasoning_content|reasoning)":\s*([\[{"])')
"""Keys of a chunk whose value is not null: finish, usage, an error, and what a continuation cannot rebuild."""
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def why_not_continuable(body: dict[str, Any], kind: Kind) -> str | None:
    """Why a broken stream of this request cannot be continued (None when it can): several choices,
    logprobs and echo cannot be spliced; tools and structured outputs would restart their parsers or
    grammars from scratch in the middle of the answer."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n > 1"
    if body.get("echo"):
        return "echo"
    chat_logprobs = kind == "chat" and (body.get("logprobs") or body.get("top_logprobs"))
    if chat_logprobs or (kind == "completion" and body.get("logprobs") is not None) or body.get("prompt_logprobs"):
        return "logprobs"
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous usage stats"
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    response_format = body.get("response_format")
    if (isinstance(response_format, dict) and response_format.get("type") not in (None, "text")) or any(
            body.get(key) is not None for key in _STRUCTURED):
        return "structured output"
    if kind == "completion":
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                            and isinstance(prompt[0], str))):
            return "prompt is not text"
    elif body.get("continue_final_message") and not isinstance((body.get("messages") or [{}])[-1].get("content"),
                                                                 str):
        return "final message is not text"
    return None


def token_budget(body: dict[str, Any]) -> int | None:
    """The answer's token limit: the smaller of ``max_tokens`` and ``max_completion_tokens`` when set."""
    limits = [body.get(key) for key in ("max_tokens", "max_completion_tokens")]
    ints = [v for v in limits if isinstance(v, int) and not isinstance(v, bool)]
    return min(ints) if ints else None


def continuation_body(body: dict[str, Any], kind: Kind, text: str, sent_tokens: int) -> dict[str, Any] | None:
    """The request that goes on from ``text`` (``sent_tokens`` tokens already sent); None when the token
    budget is spent, so the answer ends there with ``finish_reason: length``."""
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - sent_tokens < 1:
                return None
            out[key] = limit - sent_tokens
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        out["min_tokens"] = max(0, min_tokens - sent_tokens)
    if not text:
        return out  # nothing to continue from: an empty final message would be closed by the template
    if kind == "completion":
        prompt = body["prompt"]
        out["prompt"] = prompt + text if isinstance(prompt, str) else [prompt[0] + text]
        return out
    messages = list(body["messages"])
    if body.get("continue_final_message"):
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    out["messages"] = messages
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    return out


@dataclass(frozen=True)
class ContinuationSpec:
    """What the proxy needs to continue a stream: the request as sent, and the original prompt's size
    (the router's count; None when it did not tokenize)."""

    body: dict[str, Any]
    kind: Kind
    prompt_tokens: int | None = None
    max_continuations: int = MAX_CONTINUATIONS

    @classmethod
    def of(cls, body: dict[str, Any], kind: Kind, stream: bool, prompt_tokens: int,
           max_continuations: int = MAX_CONTINUATIONS) -> ContinuationSpec | None:
        """A spec for a streamed request that can be continued; None otherwise (today's SSE error)."""
        if not stream or max_continuations < 1 or why_not_continuable(body, kind) is not None:
            return None
        return cls(body, kind, prompt_tokens or None, max_continuations)

    @property
    def include_usage(self) -> bool:
        options = self.body.get("stream_options")
        return isinstance(options, dict) and bool(options.get("include_usage"))


def _events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (each with its blank line) and what is left over."""
    if len(buffer) > 2 and buffer.find(b"\n\n") == len(buffer) - 2:
        return [buffer], b""  # the usual chunk: one whole event
    end = buffer.rfind(b"\n\n")
    if end < 0:
        return [], buffer
    head, rest = buffer[:end + 2], buffer[end + 2:]
    return [event + b"\n\n" for event in head.split(b"\n\n")[:-1] if event.strip()], rest


def _data(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and event.find(b"\n") == len(event) - 2:
        return event[6:-2]  # the usual one-line event
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _object(data: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass
class StreamSplicer:
    """The client's side of a stream that may be served by several engines in turn.

    The first engine's events pass through byte for byte (only complete events: a partial one waits
    for its end). After ``begin_continuation`` the next engine's events are rewritten to the first
    one's identity; its role chunk is dropped and its usage adds the tokens sent before. An engine's
    SSE error event is never forwarded: it marks the stream broken (``engine_error``).
    """

    kind: Kind
    include_usage: bool = False
    prompt_tokens: int | None = None
    text: list[str] = field(default_factory=list)
    """Text of the continuation legs (the first leg's is kept JSON-escaped in ``_escaped``)."""
    tokens: int = 0
    """Tokens the client has received: one per event that carried text, until the relay counts them
    exactly at a break (an event may carry several)."""
    finished: bool = False
    done: bool = False
    engine_error: str | None = None
    unsplicable: str | None = None
    """Set when the answer carries something a continuation cannot rebuild (tool calls, reasoning)."""
    usage_sent: bool = False
    _escaped: list[bytes] = field(default_factory=list)
    _head: dict[str, Any] | None = None
    _buffer: bytes = b""
    _continuing: bool = False
    _tokens_before: int = 0
    """Tokens sent by the engines before the current one (its own usage counts only its own)."""

    @property
    def generated(self) -> str | None:
        """The text the client has received; None when the first engine's could not be decoded (it passed
        through as the engine sent it, an invalid JSON escape included, and nothing can continue it)."""
        try:
            first = json.loads(b'"' + b"".join(self._escaped) + b'"') if self._escaped else ""
        except ValueError:
            return None
        return first + "".join(self.text)

    @property
    def continued(self) -> bool:
        return self._continuing

    def begin_continuation(self) -> None:
        """The next bytes come from a new engine; what is left of the broken one is dropped."""
        self._buffer = b""
        self._continuing = True
        self._tokens_before = self.tokens
        self.engine_error = None

    def feed(self, chunk: bytes) -> bytes:
        """Bytes for the client from one upstream chunk. Nothing after an engine's error event."""
        if self.engine_error is not None or self.done:
            return b""
        data = self._buffer + chunk if self._buffer else chunk
        events, self._buffer = _events(data.replace(b"\r\n", b"\n") if b"\r" in data else data)
        out = []
        for event in events:
            piece = self._event(event)
            if self.engine_error is not None:
                break
            out.append(piece)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        data = _data(event)
        if data is None:
            return event  # a comment or a field the client may want; it carries no token
        if data.strip() == b"[DONE]":
            self.done = True
            return DONE
        if not self._continuing:
            return self._pass(event, data)
        obj = _object(data)
        if obj is None:
            return b""
        if "error" in obj:
            self._error(obj["error"])
            return b""
        if self._head is None:
            self._head = {k: obj.get(k) for k in ("id", "created", "model")}
        counted = self._read_choices(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            obj["usage"] = self._usage(usage)
            self.usage_sent = True
        elif not counted and not self._has_finish(obj):
            return b""  # the new engine's role chunk: the client had one already
        obj.update(self._head)
        return _sse(obj)

    def _pass(self, event: bytes, data: bytes) -> bytes:
        """A first-leg event: forwarded as it is unless it is the engine's error."""
        keys = dict(_KEYS.findall(data))
        if self._head is None or b"error" in keys:
            obj = _object(data)
            if obj is not None and "error" in obj:
                self._error(obj["error"])
                return b""
            if obj is not None and self._head is None:
                self._head = {k: obj.get(k) for k in ("id", "created", "model")}
        self._scan(data, keys)
        return event

    def _error(self, error: Any) -> None:
        message = error.get("message") if isinstance(error, dict) else error
        self.engine_error = str(message or "engine error")[:500]

    def _scan(self, data: bytes, keys: dict[bytes, bytes]) -> None:
        """What a first-leg event carries, read without decoding it: it passes through unchanged and its
        text is only needed if the stream breaks (this keeps the common case cheap)."""
        text = _TEXT.search(data)
        if text is not None and text.group(1):
            self._escaped.append(text.group(1))
            self.tokens += 1
        if keys:
            self.finished = self.finished or b"finish_reason" in keys
            self.usage_sent = self.usage_sent or b"usage" in keys
            if b"reasoning" in keys or b"reasoning_content" in keys or b"tool_calls" in keys:
                self.unsplicable = "tool calls or reasoning in the answer"

    def _read_choices(self, obj: dict[str, Any]) -> bool:
        """Collect the event's text; True when it carried some (one token)."""
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return False
        counted = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            choice["index"] = 0
            delta = choice.get("delta") if self.kind == "chat" else None
            if isinstance(delta, dict):
                if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                    self.unsplicable = "tool calls or reasoning in the answer"
                if self._continuing:
                    delta.pop("role", None)
                piece = delta.get("content")
            else:
                piece = choice.get("text")
            if isinstance(piece, str) and piece:
                self.text.append(piece)
                self.tokens += 1
                counted = True
            if choice.get("finish_reason") is not None:
                self.finished = True
        return counted

    @staticmethod
    def _has_finish(obj: dict[str, Any]) -> bool:
        choices = obj.get("choices")
        return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") is not None
                                                 for c in choices)

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation engine's usage, counted against the original prompt and every sent token."""
        own_prompt = _count(usage.get("prompt_tokens"))
        prompt = self.prompt_tokens if self.prompt_tokens is not None else max(0, own_prompt - self._tokens_before)
        completion = self._tokens_before + _count(usage.get("completion_tokens"))
        out = {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
               "total_tokens": prompt + completion}
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:
            out["prompt_tokens_details"] = {**details, "cached_tokens": min(_count(details["cached_tokens"]), prompt)}
        return out

    def ending(self, finish_reason: str | None) -> bytes:
        """Close the stream without another engine: a last chunk with ``finish_reason`` (unless one was
        sent), the usage chunk when asked for and not sent yet, and ``[DONE]``; nothing after ``[DONE]``."""
        if self.done:
            return b""
        head = self._head or {"id": "", "created": 0, "model": ""}
        base = {"id": head["id"], "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": head["created"], "model": head["model"]}
        out = []
        if not self.finished and finish_reason is not None:
            choice: dict[str, Any] = ({"index": 0, "delta": {"content": ""}, "logprobs": None}
                                      if self.kind == "chat" else {"index": 0, "text": "", "logprobs": None})
            choice["finish_reason"] = finish_reason
            out.append(_sse({**base, "choices": [choice]}))
            self.finished = True
        if self.include_usage and not self.usage_sent:
            prompt = self.prompt_tokens or 0
            usage = {"prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens}
            out.append(_sse({**base, "choices": [], "usage": usage}))
            self.usage_sent = True
        if not self.done:
            out.append(DONE)
            self.done = True
        return b"".join(out)
