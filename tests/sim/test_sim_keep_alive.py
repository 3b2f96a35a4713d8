"""The simulated engine's HTTP server closes idle keep-alive connections the way uvicorn does, races
included, over real loopback sockets."""

from __future__ import annotations

import h11
import pytest
import trio

from sim.http_server import HttpRequest, HttpResponse, _reset_on_close, serve_http

KEEP_ALIVE_S = 0.3


class Server:
    """serve_http on a free loopback port with a handler that counts what it answered."""

    def __init__(self) -> None:
        self.port = 0
        self.served = 0

    async def handle(self, req: HttpRequest) -> HttpResponse:
        self.served += 1
        return HttpResponse(200, b'{"ok":true}')


async def _start(nursery: trio.Nursery, keep_alive_s: float, close_race_s: float = 0.0) -> Server:
    server = Server()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server.port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(serve_http, listeners, server.handle, keep_alive_s, close_race_s)
    return server


async def _get(stream: trio.SocketStream, conn: h11.Connection) -> bytes:
    """One GET on an open connection; returns every byte that came back before the answer ended or the
    connection did (b"" when the server closed or reset it first)."""
    try:
        await stream.send_all(conn.send(h11.Request(method="GET", target="/", headers=[("host", "sim")]))
                              + conn.send(h11.EndOfMessage()))
    except trio.BrokenResourceError:
        return b""  # the write itself met the reset
    received = b""
    with trio.fail_after(5):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return received
            if not data:
                return received
            received += data
            conn.receive_data(data)
            while (event := conn.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.EndOfMessage):
                    conn.start_next_cycle()
                    return received


async def test_a_connection_idle_past_the_keep_alive_is_closed_by_the_server(nursery):
    server = await _start(nursery, KEEP_ALIVE_S)
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    conn = h11.Connection(h11.CLIENT)
    assert (await _get(stream, conn)).startswith(b"HTTP/1.1 200")
    idle_from = trio.current_time()
    with trio.fail_after(5):
        assert await stream.receive_some(1) == b""
    assert trio.current_time() - idle_from >= KEEP_ALIVE_S * 0.9
    await stream.aclose()


async def test_a_request_within_the_keep_alive_reuses_the_connection(nursery):
    server = await _start(nursery, KEEP_ALIVE_S)
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    conn = h11.Connection(h11.CLIENT)
    for _ in range(3):
        assert (await _get(stream, conn)).startswith(b"HTTP/1.1 200")
    assert server.served == 3
    await stream.aclose()


async def test_a_reused_connection_after_the_close_gets_no_response_byte(nursery):
    server = await _start(nursery, KEEP_ALIVE_S)
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    conn = h11.Connection(h11.CLIENT)
    await _get(stream, conn)
    await trio.sleep(KEEP_ALIVE_S * 2)
    assert await _get(stream, conn) == b""
    assert server.served == 1
    await stream.aclose()


@pytest.mark.parametrize("wait_s", [0.0, 0.05])
async def test_a_request_racing_the_close_is_reset_before_any_response_byte(nursery, wait_s):
    """With the race window as long as the keep-alive, every reused connection loses it, at any moment;
    a fresh connection's first request is never raced (uvicorn starts the timer after a response)."""
    server = await _start(nursery, keep_alive_s=5.0, close_race_s=5.0)
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    conn = h11.Connection(h11.CLIENT)
    assert (await _get(stream, conn)).startswith(b"HTTP/1.1 200")
    await trio.sleep(wait_s)
    assert await _get(stream, conn) == b""
    assert server.served == 1
    fresh = await trio.open_tcp_stream("127.0.0.1", server.port)
    assert (await _get(fresh, h11.Connection(h11.CLIENT))).startswith(b"HTTP/1.1 200")
    assert server.served == 2
    for s in (stream, fresh):
        await s.aclose()


class HangingServer(Server):
    """Answers ``/hang`` never (until cancelled, which it counts), anything else at once."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = 0

    async def handle(self, req: HttpRequest) -> HttpResponse:
        if req.path != "/hang":
            return await super().handle(req)
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled += 1
            raise


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
async def test_a_client_that_hangs_up_cancels_its_unanswered_request(nursery, reset):
    """As vLLM's server aborts a request whose client left (a waiting request then never takes a batch slot),
    and the server goes on serving."""
    server = HangingServer()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server.port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(serve_http, listeners, server.handle, KEEP_ALIVE_S)
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    conn = h11.Connection(h11.CLIENT)
    head = h11.Request(method="POST", target="/hang", headers=[("host", "sim"), ("content-length", "0")])
    await stream.send_all(conn.send(head) + conn.send(h11.EndOfMessage()))
    await trio.sleep(0.05)
    assert server.cancelled == 0
    if reset:
        _reset_on_close(stream)
    await stream.aclose()
    with trio.fail_after(5):
        while server.cancelled == 0:
            await trio.sleep(0.01)
    again = await trio.open_tcp_stream("127.0.0.1", server.port)
    assert (await _get(again, h11.Connection(h11.CLIENT))).startswith(b"HTTP/1.1 200")
    await again.aclose()


async def test_a_request_pipelined_during_a_watched_answer_is_served_after_it(nursery):
    """What the hang-up watcher reads while a POST is answered stays the next request's."""
    server = HangingServer()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server.port = listeners[0].socket.getsockname()[1]

    async def slow(req: HttpRequest) -> HttpResponse:
        if req.method == "POST":
            await trio.sleep(0.2)
        return await server.handle(req)

    nursery.start_soon(serve_http, listeners, slow, KEEP_ALIVE_S)
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    await stream.send_all(b"POST / HTTP/1.1\r\nhost: sim\r\ncontent-length: 0\r\n\r\n")
    await trio.sleep(0.05)
    await stream.send_all(b"GET / HTTP/1.1\r\nhost: sim\r\n\r\n")  # while the POST waits
    received = b""
    with trio.fail_after(5):
        while received.count(b"HTTP/1.1 200") < 2:
            received += await stream.receive_some(65536)
    assert server.served == 2
    await stream.aclose()
