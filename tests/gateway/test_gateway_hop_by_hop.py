"""HTTP semantics of the proxy: hop-by-hop headers stay on their hop, in both directions, and the request
id reaches the engine once (in-process, over loopback)."""

from __future__ import annotations

import trio
from proxy_harness import Sink, completion, engine_state

from gateway.proxy import forward

ENGINE_ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\nkeep-alive: timeout=5\r\nupgrade: h2c\r\n"
                 b"trailer: x-checksum\r\nproxy-authenticate: Basic\r\nconnection: X-Engine-Internal\r\n"
                 b"x-engine-internal: 1\r\nx-request-id: engine-echo\r\nx-end-to-end: kept\r\n\r\n"
                 b'{"ok":true}')


async def _raw_engine(nursery: trio.Nursery, received: list[bytes]) -> str:
    """An engine that records the request's bytes and answers with hop-by-hop headers of its own."""

    async def serve(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += await stream.receive_some(65536)
        received.append(head)
        await stream.send_all(ENGINE_ANSWER)
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, serve, listeners)
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def test_hop_by_hop_headers_are_not_forwarded_either_way(nursery):
    received: list[bytes] = []
    url = await _raw_engine(nursery, received)
    client_headers = [
        ("content-type", "application/json"), ("x-request-id", "abc"), ("te", "trailers"),
        ("connection", "traceparent, Keep-Alive"), ("keep-alive", "timeout=9"), ("traceparent", "00-1-2-01"),
        ("proxy-authorization", "Basic eA=="), ("upgrade", "websocket"), ("x-request-id", "abc"),
    ]
    sink = Sink()
    exchange = completion(sink, {"prompt": "x"}, headers=client_headers)
    exchange.route_header = lambda engine, attempts: [(b"x-kvmesh-route", b"engine=e"), (b"x-request-id", b"abc")]
    await forward([engine_state(url)], exchange, max_attempts=1)

    lines = received[0].decode().lower().split("\r\n")[1:]
    sent = [line.split(":", 1)[0] for line in lines]
    assert sorted(sent) == ["content-length", "content-type", "host", "x-request-id"]
    assert "x-request-id: abc" in lines

    assert sink.status == 200
    start = next(m for m in sink.messages if m["type"] == "http.response.start")
    names = [k.decode() for k, _ in start["headers"]]
    hop_by_hop = {"keep-alive", "upgrade", "trailer", "proxy-authenticate", "connection", "x-engine-internal"}
    assert not hop_by_hop & set(names)
    assert names.count("x-request-id") == 1 and sink.headers["x-request-id"] == "abc"
    assert sink.headers["x-end-to-end"] == "kept" and "x-kvmesh-route" in names
