"""Parse only what routing needs from an OpenAI request body, and reject malformed input early.

The body is forwarded to the engine as the original bytes unless the gateway must change it, so the
checks here are about what the router reads; the engine still validates the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from gateway.openai_errors import ApiError

Kind = Literal["chat", "completion"]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
    max_tokens: int | None
    user: str | None
    cache_salt: str | None


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}].role must be a string", f"messages[{i}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(f"messages[{i}].content must be a string or an array of parts", f"messages[{i}].content")


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in prompt):
            return
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return
    raise _bad("'prompt' must be a string, an array of strings, or an array of token ids", "prompt")


def _optional_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(f"'{key}' must be a non-negative integer", key)
    return value


def parse_request(raw: bytes, kind: Kind) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}", None) from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    if kind == "chat":
        _check_messages(body.get("messages"))
    else:
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt")
        _check_prompt(body["prompt"])
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    max_tokens = _optional_int(body, "max_tokens")
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _optional_int(body, "max_completion_tokens")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _bad("'cache_salt' must be a string", "cache_salt")
    return ParsedRequest(kind, body, raw, model, stream, max_tokens, user, salt)


def debug_route_kind(raw: bytes) -> Kind:
    """``POST /debug/route`` takes either body: a chat body has ``messages``, anything else is a completion."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "chat"
    return "chat" if not isinstance(body, dict) or "messages" in body else "completion"
