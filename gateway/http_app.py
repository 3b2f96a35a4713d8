"""The ASGI surface: a small path table in front of the router; no web framework on the hot path."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from gateway.openai_errors import ApiError

DRAIN_TIMEOUT_S = 5.0
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def send_json(send: Send, status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(payload).encode()
    await send_bytes(send, status, body, [(b"content-type", b"application/json"), *(headers or [])])


async def send_bytes(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: ApiError) -> None:
    await send_bytes(send, error.status, error.body(), error.headers())


async def read_body(scope: dict[str, Any], receive: Receive, limit: int, timeout_s: float = 60.0) -> bytes:
    """Read the whole request body, refusing early when it is larger than ``limit`` (413) and when it has
    not arrived within ``timeout_s`` (408): a client trickling bytes must not hold a request open forever."""
    for key, value in scope.get("headers", []):
        if key == b"content-length" and value.isdigit() and int(value) > limit:
            raise ApiError(413, f"request body is larger than the {limit}-byte limit", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout_s):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiError(499, "client disconnected", code="client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body is larger than the {limit}-byte limit", code="body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    raise ApiError(408, f"request body not received within {timeout_s:g} s", code="body_timeout")


async def drain_body(receive: Receive, limit: int) -> None:
    """Read and drop what is left of a refused body, after the answer went out: a server that closes while
    the client is still writing makes the client see a connection reset instead of the answer. Bounded by
    bytes and time; past either the connection is closed anyway."""
    received, more = 0, True
    with trio.move_on_after(DRAIN_TIMEOUT_S):
        while more and received <= limit:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            received += len(message.get("body", b""))
            more = message.get("more_body", False)


def header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None

