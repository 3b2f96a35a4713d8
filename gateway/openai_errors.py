"""Errors in OpenAI's JSON shape, so the official clients raise their usual typed exceptions."""

from __future__ import annotations

import json
from dataclasses import dataclass

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


@dataclass
class ApiError(Exception):
    """An error the gateway answers itself; nothing was sent to an engine."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code)

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            out.append((b"retry-after", str(max(1, round(self.retry_after))).encode()))
        return out


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for a status."""
    return _TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    payload = {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": code if code is not None else status,
        }
    }
    return json.dumps(payload).encode()


def sse_error_event(message: str, code: int = 502) -> bytes:
    """What a stream ends with when the engine breaks after the first byte: the openai client raises it."""
    payload = {"error": {"message": message, "type": _TYPES.get(code, "upstream_error"), "param": None,
                         "code": code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
