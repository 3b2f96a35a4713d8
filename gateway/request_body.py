"""Parse only what routing needs from an OpenAI request body, and reject malformed input early.

The body is forwarded to the engine as the original bytes unless the gateway must change it, so the
checks here are about what the router reads; the engine still validates the rest. Every way a body can
be wrong ends in an ``ApiError`` (400, 413 or 415 in OpenAI's shape), never in another exception: the
JSON is decoded as strict UTF-8, without NaN or Infinity, and then walked once without recursion to
bound nesting, string sizes and numbers and to refuse lone surrogates, which cannot be re-encoded.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.body_limits import LimitsConfig
from gateway.openai_errors import ApiError

Kind = Literal["chat", "completion"]

DEFAULT_LIMITS = LimitsConfig()
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
"""Integers anywhere in a body must fit 64 bits: no OpenAI field takes more, and engines fail on more."""
MAX_TOKENS_LIMIT = 2**31 - 1
TOKEN_ID_LIMIT = 2**32
"""Token ids are hashed as u32 (index.block_hash)."""
INT64_MAX = 2**63 - 1
MAX_N_SEQUENCES = 16_384
"""vLLM's default ``VLLM_MAX_N_SEQUENCES``: the most choices (``n``, ``best_of``) one request may ask for."""
SAMPLING_INT_RANGES: dict[str, tuple[int, int]] = {
    "n": (1, MAX_N_SEQUENCES),
    "best_of": (1, MAX_N_SEQUENCES),
    "top_k": (-1, INT64_MAX),
    "seed": (INT_MIN, INT64_MAX),
    "min_tokens": (0, INT64_MAX),
    "logprobs": (-1, INT64_MAX),
    "top_logprobs": (-1, INT64_MAX),
    "prompt_logprobs": (-1, INT64_MAX),
    "truncate_prompt_tokens": (-1, INT64_MAX),
    "thinking_token_budget": (-1, INT64_MAX),
}
"""The integer sampling fields and the ranges vLLM takes (``SamplingParams._verify_args``; ``seed`` is a
torch long in its OpenAI protocol). Above 2^63 - 1 its sampler cannot hold the value and the engine answers
500, on every engine alike (``top_k = 2**63``): such a request is refused here with a 400 before any engine
sees it. Booleans (chat's ``logprobs``) are not integers here."""
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_JSON_MEDIA = re.compile(r"^application/(?:[\w.+-]+\+)?json$")


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


class _Malformed(ValueError):
    """Raised from inside ``json.loads`` hooks; becomes a 400."""


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def check_body_headers(headers: Mapping[str, str]) -> None:
    """Refuse bodies the router cannot read as JSON (415).

    A compressed body is refused rather than inflated: inflating would need its own size bound against
    decompression bombs, and no OpenAI client compresses requests. A missing content type is read as JSON,
    as vLLM's server does."""
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding {encoding[:40]!r} is not supported; send the body uncompressed",
                       code="unsupported_media_type")
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media and not _JSON_MEDIA.match(media):
        raise ApiError(415, f"Content-Type {media[:60]!r} is not supported; use application/json",
                       code="unsupported_media_type")


def _no_constant(name: str) -> Any:
    raise _Malformed(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Duplicate keys are refused: parsers disagree on which one wins, and the engine parses the body too."""
    body = dict(pairs)
    if len(body) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Malformed(f"duplicate key {key[:60]!r}")
            seen.add(key)
    return body


def _check_string(value: str, limits: LimitsConfig) -> None:
    if len(value) > limits.max_string_chars:
        raise ApiError(413, f"a string in the request body is longer than {limits.max_string_chars} characters",
                       code="string_too_long")
    if _SURROGATE.search(value):
        raise _bad("request body contains a lone UTF-16 surrogate (\\ud800-\\udfff)")


def _plain_ints(items: list[Any]) -> bool:
    """Fast path for long arrays of plain integers (token ids): range-checked with C builtins."""
    if not items or not all(type(v) is int for v in items):
        return False
    if min(items) < INT_MIN or max(items) > INT_MAX:
        raise _bad("an integer in the request body does not fit in 64 bits")
    return True


def _walk(value: Any, limits: LimitsConfig, check_strings: bool) -> None:
    """One iterative pass over the decoded body: depth, number ranges and, when the text could hold a long
    string or a lone surrogate at all (``check_strings``), every string. Leaves are checked in place and
    only containers are stacked: a 4,096-message body takes a few milliseconds."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise _bad(f"request body is nested deeper than {limits.max_depth} levels")
        if type(node) is dict:
            if check_strings:
                for key in node:
                    _check_string(key, limits)
            children: Any = node.values()
        elif _plain_ints(node):
            continue
        else:
            children = node
        for child in children:
            kind = type(child)
            if kind is str:
                if check_strings:
                    _check_string(child, limits)
            elif kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif kind is int:
                if not INT_MIN <= child <= INT_MAX:
                    raise _bad("an integer in the request body does not fit in 64 bits")
            elif kind is float and not math.isfinite(child):
                raise _bad("a number in the request body is out of range")


def load_json_object(raw: bytes, limits: LimitsConfig = DEFAULT_LIMITS) -> dict[str, Any]:
    """Decode a body that must be one JSON object, within ``limits``; every failure is an ``ApiError``."""
    if not raw.strip():
        raise _bad("request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _bad(f"request body is nested deeper than {limits.max_depth} levels") from None
    except _Malformed as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    except ValueError:  # an integer of more than 4,300 digits
        raise _bad("an integer in the request body does not fit in 64 bits") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    # Lone surrogates can only come from \\u escapes (raw ones fail UTF-8 decoding); no string is longer
    # than the text that holds it.
    check_strings = len(text) > limits.max_string_chars or bool(_SURROGATE_ESCAPE.search(text))
    _walk(body, limits, check_strings)
    return body


def _check_content(content: Any, where: str, limits: LimitsConfig) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string, an array of parts, or null", where)
    if len(content) > limits.max_content_parts:
        raise _bad(f"{where} has more than {limits.max_content_parts} parts", where)
    for j, part in enumerate(content):
        if isinstance(part, str):
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{where}[{j}] must be an object with a string 'type'", f"{where}[{j}]")


def _check_messages(messages: Any, limits: LimitsConfig) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    if len(messages) > limits.max_messages:
        raise _bad(f"'messages' has more than {limits.max_messages} entries", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}].role must be a string", f"messages[{i}].role")
        _check_content(message.get("content"), f"messages[{i}].content", limits)


def _token_ids(items: list[Any]) -> bool:
    return all(type(t) is int for t in items) and (not items or min(items) >= 0 and max(items) < TOKEN_ID_LIMIT)


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or _token_ids(prompt):
            return
        if all(isinstance(p, list) and p and _token_ids(p) for p in prompt):
            return
    raise _bad("'prompt' must be a string, an array of strings, or an array of token ids (0 <= id < 2^32)",
               "prompt")


def _optional_int(body: dict[str, Any], key: str, maximum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= maximum:
        raise _bad(f"'{key}' must be an integer between 0 and {maximum}", key)
    return value


def _check_sampling_ints(body: dict[str, Any]) -> None:
    for key, (low, high) in SAMPLING_INT_RANGES.items():
        value = body.get(key)
        if type(value) is int and not low <= value <= high:
            raise _bad(f"'{key}' must be an integer between {low} and {high}", key)


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(f"'{key}' must be a string", key)
    return value


def parse_request(raw: bytes, kind: Kind | None, limits: LimitsConfig = DEFAULT_LIMITS) -> ParsedRequest:
    """What routing reads from a body. ``kind=None`` (``POST /debug/route``) takes either shape: a body
    with ``messages`` is a chat request, anything else a completion."""
    body = load_json_object(raw, limits)
    if kind is None:
        kind = "chat" if "messages" in body else "completion"
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    if kind == "chat":
        _check_messages(body.get("messages"), limits)
    else:
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt")
        _check_prompt(body["prompt"])
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    _check_sampling_ints(body)
    max_tokens = _optional_int(body, "max_tokens", MAX_TOKENS_LIMIT)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _optional_int(body, "max_completion_tokens", MAX_TOKENS_LIMIT)
    return ParsedRequest(kind, body, raw, model, stream, max_tokens, _optional_str(body, "user"),
                         _optional_str(body, "cache_salt"))
