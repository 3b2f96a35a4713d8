"""vLLM's OpenAI-compatible request parsing and response shapes (sans-IO).

JSON is compact (pydantic's `model_dump_json`), SSE events are `data: <json>\\n\\n` and the stream
ends with `data: [DONE]\\n\\n`. Streaming chat: the first chunk carries the role with empty content,
each token's text follows in its own chunk, the last text chunk carries finish_reason and
stop_reason, then an optional usage chunk with `choices: []`. Unknown fields are ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """An error answered with vLLM's error JSON."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @property
    def type(self) -> str:
        return {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError", 500: "InternalServerError"}.get(
            self.status, "BadRequestError"
        )

    def body(self) -> bytes:
        return dumps({"error": {"message": self.message, "type": self.type, "param": self.param,
                                "code": self.status}})


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("The request body must be a JSON object")
    return data


def _opt_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if type(v) is not int or v < minimum:
        raise ApiError(f"{name} must be an integer >= {minimum}", param=name)
    return v


@dataclass(frozen=True, slots=True)
class GenParams:
    """The fields of a generation request the simulator acts on."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    seed: int | None
    cache_salt: str | None
    report_full: bool
    adapter: str | None = None
    """The LoRA adapter the request names instead of the base model."""


def parse_generation(body: dict[str, Any], served_model: str, chat: bool,
                     adapters: Collection[str] = ()) -> GenParams:
    model = body.get("model", served_model)
    if model is None:
        model = served_model
    if model != served_model and model not in adapters:
        raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    if opts and not stream:
        raise ApiError("Stream options can only be defined when `stream=True`.", param="stream_options")
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise ApiError("the simulated engine supports n=1 only", param="n")
    max_tokens = _opt_int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    top_k = body.get("top_k")
    if type(top_k) is int and not -(2**63) <= top_k < 2**63:
        raise ApiError("", status=500)  # vLLM 0.32 fails inside the engine, on every engine alike
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise ApiError("vllm_xargs must be an object", param="vllm_xargs")
    return GenParams(
        model=served_model,
        stream=stream,
        include_usage=bool(opts and opts.get("include_usage")),
        max_tokens=max_tokens,
        seed=_opt_int(body, "seed", -(2**63)),
        cache_salt=salt,
        report_full=bool(xargs and xargs.get("kv_cache_report_mode") == "full"),
        adapter=model if model != served_model else None,
    )


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The fields every chunk of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool

    def _base(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def role_chunk(self) -> bytes:
        return sse(self._base([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]))

    def text_chunk(self, text: str, finish_reason: str | None) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                      "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = None
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
        return sse(self._base([choice]))

    def usage_chunk(self, use: dict[str, Any]) -> bytes:
        obj = self._base([])
        obj["usage"] = use
        return sse(obj)

    def full_response(self, text: str, finish_reason: str, use: dict[str, Any],
                      kv_transfer_params: dict[str, Any] | None = None) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            obj = "text_completion"
        return dumps({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                      "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": use,
                      "prompt_logprobs": None, "kv_transfer_params": kv_transfer_params})


def models_body(model: str, root: str, max_model_len: int, created: int,
                adapters: Sequence[tuple[str, str]] = ()) -> bytes:
    """The base model's card, then one per LoRA adapter: vLLM names the base as an adapter's ``parent``, its
    path as ``root``, and gives it no ``max_model_len`` (null)."""

    def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": max_model_len if parent is None else None,
                "permission": [{"id": "modelperm-" + uuid.uuid5(uuid.NAMESPACE_URL, name).hex,
                                "object": "model_permission", "created": created, "allow_create_engine": False,
                                "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
                                "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                                "group": None, "is_blocking": False}]}

    cards = [card(model, root, None), *(card(name, path, model) for name, path in adapters)]
    return dumps({"object": "list", "data": cards})
