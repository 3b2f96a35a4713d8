"""Helpers for the untrusted-engine tests: engines that answer canned bodies per path, and a router driven
through its ASGI interface in the test's own trio run (an exception escaping any router task fails the test)."""

from __future__ import annotations

import json
import re
from typing import Any

import trio

from gateway.router import Router

HEALTHY = {"/health": b"{}", "/metrics": b"vllm:num_requests_running 0\n"}


def http_response(status: int, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, len(body), body)


async def serve_canned(answers: dict[str, bytes], task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A loopback engine that answers PATH (any method) with ``answers[PATH]`` (404 for other paths)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                request += chunk
            head, _, body = request.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            while length and len(body) < int(length.group(1)):  # read the body: closing on it would reset
                body += await stream.receive_some(65536)
            path = request.split(b" ", 2)[1].decode()
            body = answers.get(path)
            await stream.send_all(http_response(200, body) if body is not None else http_response(404, b""))

    await trio.serve_listeners(handle, listeners)


async def asgi(router: Router, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    """One request through the router's ASGI callable; returns (status, body)."""
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    sent = False
    status, chunks = 0, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await router(scope, receive, send)
    return status, b"".join(chunks)
