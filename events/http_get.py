"""A minimal one-shot HTTP/1.1 GET over trio with h11, for /metrics and /kv_event_sources polls.

The gateway's pooled upstream client may replace it: pollers only need an async fetch(url) -> bytes.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import h11
import trio

DEFAULT_MAX_BODY = 8 * 1024 * 1024


class HttpGetError(Exception):
    """Non-200 status, oversized body or a broken response."""


async def http_get(url: str, *, max_body: int = DEFAULT_MAX_BODY) -> bytes:
    """GET `url` and return the body; the caller bounds the time with a trio cancel scope."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise HttpGetError(f"unsupported url {url!r}")
    port = parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream(parts.hostname, port)
    async with stream:
        request = h11.Request(method="GET", target=target,
                              headers=[("Host", parts.netloc), ("Connection", "close")])
        await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
        body = bytearray()
        status = 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise HttpGetError("malformed response") from exc
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_body:
                    raise HttpGetError("body too large")
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise HttpGetError("connection closed before the response ended")
    if status != 200:
        raise HttpGetError(f"status {status}")
    return bytes(body)
