"""The router's HTTP server (gateway.asgi_server) against raw sockets: keep-alive and pipelining, the ASGI
scope, a client that leaves mid-stream, malformed heads, 100-continue, an application failure, shutdown."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from gateway.asgi_server import HANGUP_EXTENSION, ServerSettings, serve


async def start(nursery: trio.Nursery, app, **settings: Any) -> tuple[int, trio.Event]:
    stop = trio.Event()
    binds = await nursery.start(serve, app, ServerSettings("127.0.0.1", 0, **settings), stop.wait)
    return int(binds[0].rsplit(":", 1)[1]), stop


async def read_until(stream: trio.SocketStream, marker: bytes, count: int = 1) -> bytes:
    data = b""
    with trio.fail_after(5):
        while data.count(marker) < count:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
    return data


async def echo(scope: dict[str, Any], receive, send) -> None:
    """Answers with the method, path, query and body it got."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    text = f"{scope['method']} {scope['path']} {scope['query_string'].decode()} {len(body)}".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(text)).encode())]})
    await send({"type": "http.response.body", "body": text})


async def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, echo)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"POST /a%20b?x=1 HTTP/1.1\r\nhost: h\r\ncontent-length: 5\r\n\r\nhello"
                              b"GET /second HTTP/1.1\r\nhost: h\r\n\r\n")
        data = await read_until(stream, b"HTTP/1.1 200", 2)
        assert b"POST /a b x=1 5" in data
        assert data.index(b"POST /a b") < data.index(b"GET /second  0")
        assert b"date: " in data.lower() and b"server: kvmesh" in data.lower()
        await stream.aclose()
        stop.set()


async def test_a_client_gone_mid_stream_is_a_disconnect_and_sends_do_not_raise():
    seen: list[str] = []
    done = trio.Event()

    async def streaming(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        seen.append((await receive())["type"])
        for _ in range(3):
            await send({"type": "http.response.body", "body": b"more", "more_body": True})
        seen.append("sent after")
        done.set()

    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, streaming)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
        assert b"first" in await read_until(stream, b"first")
        await stream.aclose()
        with trio.fail_after(5):
            await done.wait()
        assert seen == ["http.disconnect", "sent after"]
        stop.set()


async def test_the_hangup_watch_reports_a_client_gone_while_its_answer_waits_and_no_other():
    """The router waits for an engine with no task reading the client's socket: the server's hangup watch
    must still tell it the client left (so the engine's work is cancelled), and only for a watched request:
    a client that closes after its watched request ended, or one that pipelines its next request, is not
    reported."""
    hung_up: list[str] = []
    release = trio.Event()

    async def waiting(scope, receive, send) -> None:
        await receive()
        path = scope["path"]
        with trio.CancelScope() as scope_, scope["extensions"][HANGUP_EXTENSION](
                lambda: (hung_up.append(path), scope_.cancel())):
            if path == "/wait":
                await trio.sleep_forever()
            await release.wait()
        if not scope_.cancelled_caught:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, waiting)
        kept = await trio.open_tcp_stream("127.0.0.1", port)
        # Answered while a pipelined second request is already in the socket: data is not a hangup.
        await kept.send_all(b"GET /answered HTTP/1.1\r\nhost: h\r\n\r\nGET /answered HTTP/1.1\r\nhost: h\r\n\r\n")
        await trio.sleep(0.2)
        release.set()
        assert (await read_until(kept, b"ok", 2)).count(b"200") == 2
        await kept.aclose()  # gone after its requests ended: nothing to report
        gone = await trio.open_tcp_stream("127.0.0.1", port)
        await gone.send_all(b"GET /wait HTTP/1.1\r\nhost: h\r\n\r\n")
        await trio.sleep(0.2)
        await gone.aclose()
        with trio.fail_after(5):
            while not hung_up:
                await trio.sleep(0.01)
        await trio.sleep(0.2)
        assert hung_up == ["/wait"]
        stop.set()


async def test_a_failing_hangup_callback_is_logged_and_later_hangups_are_still_reported(caplog):
    hung_up: list[str] = []

    async def waiting(scope, receive, send) -> None:
        await receive()
        path = scope["path"]

        def gone() -> None:
            hung_up.append(path)
            if path == "/bug":
                raise RuntimeError("application bug")

        with scope["extensions"][HANGUP_EXTENSION](gone):
            with trio.move_on_after(5):
                while path not in hung_up:
                    await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, waiting)
        for path in ("/bug", "/next"):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(f"GET {path} HTTP/1.1\r\nhost: h\r\n\r\n".encode())
            await trio.sleep(0.1)
            await stream.aclose()
            with trio.fail_after(5):
                while path not in hung_up:
                    await trio.sleep(0.01)
        assert hung_up == ["/bug", "/next"]
        assert "a hangup callback failed" in caplog.text
        stop.set()


async def test_without_epoll_the_server_offers_no_hangup_watch_and_still_serves(monkeypatch):
    """Elsewhere than Linux the router falls back to waiting on ``receive`` (it checks for the extension)."""
    import select

    monkeypatch.delattr(select, "epoll")
    offered: list[bool] = []

    async def app(scope, receive, send) -> None:
        offered.append(HANGUP_EXTENSION in scope["extensions"])
        await echo(scope, receive, send)

    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, app)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /x HTTP/1.1\r\nhost: h\r\n\r\n")
        assert b"GET /x  0" in await read_until(stream, b"GET /x")
        assert offered == [False]
        await stream.aclose()
        stop.set()


@pytest.mark.parametrize(("sent", "status"), [
    (b"NOT HTTP AT ALL\r\n\r\n", b"400"),
    (b"GET / HTTP/1.1\r\nhost: h\r\nx-big: " + b"a" * 4096, b"431"),  # past 1 KiB and still no end of head
])
async def test_a_head_that_cannot_be_served_is_answered_and_the_connection_closes(sent, status):
    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, echo, max_head_bytes=1024)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(sent)
        assert (await read_until(stream, b"never")).startswith(b"HTTP/1.1 " + status)  # then EOF
        stop.set()


async def test_expect_100_continue_is_answered_when_the_body_is_read():
    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, echo)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"POST /x HTTP/1.1\r\nhost: h\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\n")
        assert (await read_until(stream, b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
        await stream.send_all(b"abc")
        assert b"POST /x  3" in await read_until(stream, b"POST /x")
        stop.set()


async def test_an_application_that_fails_before_answering_gives_500():
    async def broken(scope, receive, send) -> None:
        raise ValueError("a bug")

    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, broken)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
        assert (await read_until(stream, b"never")).startswith(b"HTTP/1.1 500")
        stop.set()


async def test_a_head_h11_cannot_send_is_a_500_and_the_server_keeps_serving():
    async def bad_header(scope, receive, send) -> None:
        if scope["path"] == "/bad":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"x-bad", b"line\r\nbreak")]})
        await echo(scope, receive, send)

    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, bad_header)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /bad HTTP/1.1\r\nhost: h\r\n\r\n")
        assert (await read_until(stream, b"never")).startswith(b"HTTP/1.1 500")
        again = await trio.open_tcp_stream("127.0.0.1", port)
        await again.send_all(b"GET /good HTTP/1.1\r\nhost: h\r\n\r\n")
        assert b"GET /good" in await read_until(again, b"GET /good")
        stop.set()


async def test_shutdown_closes_idle_connections_and_lets_a_request_in_flight_finish():
    release = trio.Event()

    async def slow(scope, receive, send) -> None:
        await receive()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": b"done"})

    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, slow)
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        busy = await trio.open_tcp_stream("127.0.0.1", port)
        await busy.send_all(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
        await trio.sleep(0.05)
        stop.set()
        assert await read_until(idle, b"never") == b""  # closed without an answer
        release.set()
        assert (await read_until(busy, b"done")).endswith(b"done")
        assert await read_until(busy, b"never") == b""  # and then closed


STREAMED = b"data: 1\n\n" + b"data: \x00\r\n" * 300 + b"data: [DONE]\n\n"


async def _stream_pieces(scope, receive, send) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for piece in (b"data: 1\n\n", b"", bytearray(b"data: \x00\r\n" * 300), b"data: [DONE]\n\n"):
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_a_streamed_answer_framed_by_the_server_reads_back_whole_and_keeps_the_connection():
    """The server writes the chunks of a chunked answer itself (h11 the head and the end): an HTTP client
    gets every byte, empty and bytearray pieces included, and the connection serves the next request."""
    import h11

    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, _stream_pieces)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        client = h11.Connection(h11.CLIENT)
        for _ in range(2):
            await stream.send_all(client.send(h11.Request(method="GET", target="/", headers=[("host", "h")]))
                                  + client.send(h11.EndOfMessage()))
            body, head = b"", None
            with trio.fail_after(5):
                while not isinstance(event := client.next_event(), h11.EndOfMessage):
                    if event is h11.NEED_DATA:
                        client.receive_data(await stream.receive_some(65536))
                    elif isinstance(event, h11.Response):
                        head = event
                    else:
                        body += event.data
            assert body == STREAMED
            assert head is not None and dict(head.headers)[b"transfer-encoding"] == b"chunked"
            client.start_next_cycle()
        await stream.aclose()
        stop.set()


async def test_an_http_1_0_client_gets_the_streamed_answer_unframed():
    async with trio.open_nursery() as nursery:
        port, stop = await start(nursery, _stream_pieces)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.0\r\nhost: h\r\n\r\n")
        data = await read_until(stream, b"never sent")
        head, _, body = data.partition(b"\r\n\r\n")
        assert body == STREAMED and b"transfer-encoding" not in head.lower()
        await stream.aclose()
        stop.set()
