"""Upstream connections against uvicorn's keep-alive behaviour, in-process over loopback: stale pooled
connections are replaced by fresh ones, idle ones are dropped in time, polls keep their own, bodies and
sends are bounded, and odd engine URLs never raise."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from proxy_harness import start_server

from gateway.upstream import EnginePool, UpstreamError
from sim.http_server import HttpRequest, HttpResponse


async def answer_after_a_moment(req: HttpRequest) -> HttpResponse:
    """Slow enough that concurrent requests need connections of their own."""
    await trio.sleep(0.05)
    return HttpResponse(200, b'{"ok":true}')


async def _ok(pool: EnginePool, path: str = "/v1/x") -> int:
    response = await pool.request("POST", path, b"{}")
    try:
        await response.read(5)
        return response.status
    finally:
        await response.aclose()


async def _fill_pool(pool: EnginePool, n: int) -> None:
    """Leave ``n`` connections idle in the pool."""
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(_ok, pool)
    assert pool.idle_connections == n


async def test_a_stale_pooled_connection_is_retried_on_a_fresh_one_not_another_pooled_one(nursery):
    """Every reused connection loses the race with the engine's keep-alive close: each request still
    succeeds, on a fresh connection, on the first retry."""
    server = await start_server(nursery, answer_after_a_moment, keep_alive_s=5.0, close_race_s=5.0)
    pool = EnginePool(server.url)
    await _fill_pool(pool, 3)
    assert server.connections == 3
    for _ in range(3):
        assert await _ok(pool) == 200
    assert server.connections == 3 + 3
    await pool.aclose()


async def test_a_failure_on_a_fresh_connection_is_an_upstream_error(nursery):
    async def slam(req: HttpRequest) -> HttpResponse:
        raise trio.BrokenResourceError  # the server drops the connection without answering

    server = await start_server(nursery, slam)
    pool = EnginePool(server.url)
    with pytest.raises(UpstreamError, match="failed before answering"):
        await pool.request("GET", "/")
    await pool.aclose()


async def answer_at_once(req: HttpRequest) -> HttpResponse:
    return HttpResponse(200, b'{"ok":true}')


async def test_idle_connections_are_dropped_at_the_idle_limit(nursery, mock_clock):
    """Time moves only when the test jumps the clock, so the engine's own timer never fires."""
    server = await start_server(nursery, answer_at_once, keep_alive_s=1000.0)
    pool = EnginePool(server.url, idle_limit_s=4.0)
    assert await _ok(pool) == 200
    mock_clock.jump(3.9)
    assert await _ok(pool) == 200
    assert server.connections == 1
    mock_clock.jump(4.0)
    assert await _ok(pool) == 200
    assert server.connections == 2 and pool.idle_connections == 1
    await pool.aclose()


async def test_a_second_burst_of_256_concurrent_requests_opens_no_new_connection(nursery):
    """256 streams to one engine end together and start again: the next burst reuses every connection."""
    server = await start_server(nursery, answer_after_a_moment, keep_alive_s=1000.0)
    # No idle limit in reach: on a loaded machine a burst can outlast the default 4 s, and connections
    # pruned for age would be reopened for that reason, not for the pool's capacity.
    pool = EnginePool(server.url, idle_limit_s=1000.0)
    await _fill_pool(pool, 256)
    await _fill_pool(pool, 256)
    assert server.connections == 256
    await pool.aclose()


async def test_health_polls_do_not_use_the_request_connections(nursery):
    """The engine closed every pooled request connection; a poll still gets through at once."""
    server = await start_server(nursery, answer_after_a_moment, keep_alive_s=0.2)
    pool = EnginePool(server.url)
    await _fill_pool(pool, 2)
    await trio.sleep(0.5)
    assert await pool.get("/health") == (200, b'{"ok":true}')
    assert pool.idle_connections == 2
    await pool.aclose()


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_poll_answer_over_the_limit_is_an_upstream_error(nursery, streamed):
    async def chunks():
        for _ in range(5):
            yield b"x" * 1000

    async def big(req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, stream=chunks()) if streamed else HttpResponse(200, b"x" * 5000)

    server = await start_server(nursery, big)
    pool = EnginePool(server.url)
    with pytest.raises(UpstreamError, match="limit"):
        await pool.get("/metrics", max_bytes=4096)
    assert await pool.get("/metrics", max_bytes=5000) == (200, b"x" * 5000)
    await pool.aclose()


async def test_an_engine_that_stops_reading_cannot_hang_the_send(nursery):
    async def never_read(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, never_read, listeners)
    pool = EnginePool(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    with trio.fail_after(10), pytest.raises(UpstreamError, match="did not take the request"):
        await pool.request("POST", "/v1/completions", b"x" * (64 * 1024 * 1024), send_timeout=0.5)


@pytest.mark.parametrize(
    ("url", "host_header"),
    [
        ("http://user:secret@engine:8000", "engine:8000"),
        ("http://engine:80/", "engine"),
        ("https://engine", "engine"),
        ("http://bücher.example:8000", "xn--bcher-kva.example:8000"),
        ("http://[::1]:8000", "[::1]:8000"),
        ("http://engine:notaport", None),
        ("http://engine:99999", None),
        ("http://a..b:8000", None),
        ("http://:8000", None),
    ],
)
async def test_the_host_header_is_built_safely_from_any_url(url, host_header):
    pool = EnginePool(url)
    assert pool.host_header == host_header
    assert "secret" not in pool.label
    if host_header is None:
        with pytest.raises(UpstreamError, match="no valid host"):
            await pool.request("GET", "/")


async def test_headers_http_cannot_carry_are_dropped_not_raised(nursery):
    seen: list[dict[str, str]] = []

    async def record(req: HttpRequest) -> HttpResponse:
        seen.append(req.headers)
        return HttpResponse(200)

    server = await start_server(nursery, record)
    pool = EnginePool(server.url)
    for value in ("caf\u00e9", "snow\u2603man"):
        response = await pool.request("GET", "/", headers=[("x-request-id", value), ("traceparent", "00-ab")])
        await response.read(5)
        await response.aclose()
    assert seen[0]["x-request-id"] == "caf\u00e9" and "x-request-id" not in seen[1]
    assert seen[1]["traceparent"] == "00-ab" and server.connections == 1
    await pool.aclose()


async def _raw_pool(nursery, handler) -> EnginePool:
    """A pool for an engine that is ``handler`` on raw sockets (it writes whatever bytes it likes)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, handler, listeners)
    return EnginePool(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")


async def test_body_chunks_one_read_brought_together_go_on_as_one(nursery):
    """An engine ahead of the router: SSE chunks already in hand are relayed in one write, not one each."""
    events = [f"data: {{\"n\": {i}}}\n\n".encode() for i in range(5)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"

    async def burst(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"transfer-encoding: chunked\r\n\r\n" + chunked)
        await trio.sleep_forever()

    pool = await _raw_pool(nursery, burst)
    with trio.fail_after(10):
        response = await pool.request("POST", "/v1/completions", b"{}", [])
        await trio.sleep(0.2)  # the whole answer is in the socket before the first read of the body
        chunks = [chunk async for chunk in response.iter_body(5.0)]
    assert b"".join(chunks) == b"".join(events) and len(chunks) < len(events)
    await response.aclose()
    await pool.aclose()


async def _raw_engine(nursery, answer: bytes) -> tuple[EnginePool, list[int]]:
    """An engine that answers every request on a connection with ``answer`` (bytes as given); the list counts
    its connections."""
    connections = [0]

    async def serve(stream: trio.SocketStream) -> None:
        connections[0] += 1
        request = b""
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            request += data
            while b"\r\n\r\n{}" in request:
                request = request.split(b"\r\n\r\n{}", 1)[1]
                await stream.send_all(answer)

    return await _raw_pool(nursery, serve), connections


_CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(("head", "tail", "reused"), [
    (_CHUNKED_HEAD, b"", True), (_CHUNKED_HEAD, b"HTTP/1.1 200 OK\r\n", False),
    (_CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n"), b"", False),
    (_CHUNKED_HEAD.replace(b"HTTP/1.1", b"HTTP/1.0"), b"", False),
])
async def test_a_chunked_answer_read_to_its_end_leaves_its_connection_reusable_unless_bytes_follow_or_it_closes(
        nursery, head, tail, reused):
    pool, connections = await _raw_engine(nursery, head + b"5;x=1\r\nhello\r\n1\r\n!\r\n0\r\n\r\n" + tail)
    with trio.fail_after(10):
        for _ in range(2):
            response = await pool.request("POST", "/v1/completions", b"{}", [])
            first = await anext(response.iter_body(5.0))
            assert first + await response.read(5.0) == b"hello!"  # a second iteration goes on from the first
            await response.aclose()
    assert connections[0] == (1 if reused else 2)
    await pool.aclose()


@pytest.mark.parametrize("body", [b"5\r\nhelloXX", b"zz\r\n", b"5\r\nhel"])
async def test_a_broken_or_cut_chunked_answer_is_an_upstream_error(nursery, body):
    async def once(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(_CHUNKED_HEAD + body)
        await stream.aclose()

    pool = await _raw_pool(nursery, once)
    with trio.fail_after(10):
        response = await pool.request("POST", "/v1/completions", b"{}", [])
        with pytest.raises(UpstreamError, match="broke the response|closed the connection"):
            await response.read(5.0)
        await response.aclose()
    assert pool.idle_connections == 0
    await pool.aclose()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",
    _CHUNKED_HEAD + b"3\r\nabc\r\n",
])
async def test_an_answer_that_stops_mid_body_is_a_stall_after_the_idle_timeout(nursery, answer):
    """Each engine read waits on the socket with the run's stall watch as its timeout, framed by length or in
    chunks: the first bytes come through, the silence after them is an error, and the connection is dropped."""
    async def stall(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        await stream.send_all(answer)
        await trio.sleep_forever()

    pool = await _raw_pool(nursery, stall)
    response = await pool.request("POST", "/v1/completions", b"{}", [])
    body = response.iter_body(0.3)
    started = trio.current_time()
    with trio.fail_after(10):
        if answer.startswith(_CHUNKED_HEAD):
            assert await anext(body) == b"abc"
        with pytest.raises(UpstreamError, match="stalled mid-response"):
            async for _ in body:
                pass
    assert trio.current_time() - started >= 0.3
    await response.aclose()
    assert pool.idle_connections == 0
    await pool.aclose()


async def _accepted(server) -> int:
    """Connections the engine's server has accepted once every task waits (a connect the kernel completed is
    accepted by the server's task a pass later)."""
    await trio.testing.wait_all_tasks_blocked()
    return server.connections


async def test_an_engine_in_use_is_kept_a_young_connection_ahead_of_need(nursery, mock_clock):
    """A request seconds after the last one finds a pooled connection: the keep-warm opened it before the
    old one aged out, so no connect is on the request's way (without it the request opens a third)."""
    server = await start_server(nursery, answer_at_once, keep_alive_s=1000.0)
    pool = EnginePool(server.url, idle_limit_s=4.0)
    assert await _ok(pool) == 200
    mock_clock.jump(2.0)
    assert await pool.keep_warm() == pytest.approx(trio.current_time() + 1.0)  # the idle one is young enough
    assert await _accepted(server) == 1
    mock_clock.jump(1.5)
    due = await pool.keep_warm()
    assert await _accepted(server) == 2 and due == pytest.approx(trio.current_time() + 3.0)
    mock_clock.jump(3.0)
    assert await _ok(pool) == 200
    assert await _accepted(server) == 2
    await pool.aclose()


async def test_an_engine_with_requests_in_flight_is_not_given_another_connection(nursery, mock_clock):
    """Their connections come back young when they end: under load the keep-warm would only add connections."""
    server = await start_server(nursery, answer_at_once, keep_alive_s=1000.0)
    pool = EnginePool(server.url, idle_limit_s=4.0)
    assert await _ok(pool) == 200
    mock_clock.jump(3.5)
    assert await pool.keep_warm(in_use=True) == pytest.approx(trio.current_time() + 1.0)
    assert await _accepted(server) == 1
    await pool.keep_warm(in_use=False)
    assert await _accepted(server) == 2
    await pool.aclose()


async def test_an_engine_without_requests_for_a_minute_is_not_kept_warm(nursery, mock_clock):
    server = await start_server(nursery, answer_at_once, keep_alive_s=1000.0)
    pool = EnginePool(server.url, idle_limit_s=4.0)
    await pool.keep_warm()
    assert await _accepted(server) == 0
    assert await _ok(pool) == 200
    mock_clock.jump(61.0)
    await pool.keep_warm()
    assert await _accepted(server) == 1 and pool.idle_connections == 1  # the old one, dropped at its next use
    await pool.aclose()
