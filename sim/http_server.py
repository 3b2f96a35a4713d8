"""A lean HTTP/1.1 server (h11 over trio streams) with keep-alive and streamed responses.

Many simulated engines share one process and one core, so the per-request cost matters more than
features: this avoids the ASGI layer entirely (measured: ~40 us per ASGI send). Streamed
bodies use chunked transfer encoding like uvicorn in front of vLLM.

Idle keep-alive connections are closed the way uvicorn (vLLM's server) closes them: a timer of
`keep_alive_s` (uvicorn's `timeout_keep_alive`, 5 s in vLLM) starts when a response is complete, any byte
of a next request cancels it, and when it fires the transport is closed. A client that reuses the
connection after that meets EOF or a reset before any response byte. The close can also race a request
that is already on its way: uvicorn's event loop may run the timer before it reads bytes that arrived
just before it, and closing a socket with unread bytes makes the kernel answer with a reset.
`close_race_s` reproduces that race on purpose: a request on a reused connection whose first bytes arrive
less than `close_race_s` before the timer would fire is answered with a reset (`close_race_s >=
keep_alive_s`: every reused connection loses the race, which makes it deterministic in tests).
"""

from __future__ import annotations

import email.utils
import logging
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import h11
import trio

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024 * 1024
RECV = 65536


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


@dataclass(slots=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    stream: AsyncIterator[bytes] | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


class _Date:
    """The Date header, formatted at most once per second."""

    def __init__(self) -> None:
        self._sec = -1
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._sec:
            self._sec = now
            self._value = email.utils.formatdate(now, usegmt=True).encode()
        return self._value


_date = _Date()


class _Conn:
    def __init__(self, stream: trio.SocketStream, keep_alive_s: float, close_race_s: float) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_BODY)
        self.keep_alive_s = keep_alive_s
        self.close_race_s = close_race_s
        self.served = 0
        self.idle_since = trio.current_time()
        self.hung_up = False
        self.fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
        """The socket ``send`` writes into directly (None for a stream without one, as in-process tests use)."""

    async def send(self, event: h11.Event) -> None:
        """Write ``event``'s bytes as uvicorn's transport does: straight into the socket when the kernel takes them
        all, with no pass of the event loop; the rest (or a stream without a socket, as in-process tests use) goes
        through trio, which waits for room. vLLM's server writes a stream's role chunk and first token back to back
        so. trio's ``send_all`` ends every write with a pass of the scheduler, in which every other simulated engine
        of the process (a fleet shares one) ran its ready tasks between the two: a gap a real engine's answer does
        not have."""
        data = self.h11.send(event)
        if not data:
            return
        sent = 0
        if self.fd is not None:
            try:
                sent = os.write(self.fd, data)
            except BlockingIOError:
                pass
            except OSError as exc:  # the peer is gone: what ``send_all`` would raise
                raise trio.BrokenResourceError(str(exc)) from exc
        if sent < len(data):
            await self.stream.send_all(memoryview(data)[sent:])

    async def next_event(self, timeout: float) -> h11.Event:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            with trio.move_on_after(timeout) as scope:
                data = await self.stream.receive_some(RECV)
            if scope.cancelled_caught:
                return h11.ConnectionClosed()
            self.h11.receive_data(data)

    async def next_request_begins(self) -> bool:
        """Wait for the first bytes of the next request under the keep-alive timer; False when the
        connection is to be closed (the timer fired, or it lost the race with a request)."""
        if self.h11.trailing_data[0]:
            return True
        deadline = self.idle_since + self.keep_alive_s
        data: bytes | None = None
        with trio.move_on_at(deadline):
            data = await self.stream.receive_some(RECV)
        if data is None:
            return False
        if data and self.served and trio.current_time() >= deadline - self.close_race_s:
            _reset_on_close(self.stream)
            return False
        self.h11.receive_data(data)
        return True

    async def read_request(self) -> HttpRequest | None:
        if not await self.next_request_begins():
            return None
        event = await self.next_event(60.0)
        if not isinstance(event, h11.Request):
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            part = await self.next_event(60.0)
            if isinstance(part, h11.Data):
                size += len(part.data)
                if size > MAX_BODY:
                    raise h11.RemoteProtocolError("body too large", error_status_hint=413)
                chunks.append(part.data)
            elif isinstance(part, h11.EndOfMessage):
                break
            else:
                return None
        target = event.target.decode("latin-1")
        path, _, query = target.partition("?")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
        return HttpRequest(event.method.decode(), path, query, headers, b"".join(chunks))

    async def answer(self, handler: Handler, req: HttpRequest) -> bool:
        """Handle ``req`` and send the response; False when the client hung up first. During a POST (the
        generate endpoints) the client is watched and a hang-up cancels the handler and its stream, which aborts
        the engine request, as vLLM's server does (``with_cancellation`` and Starlette's disconnect listener): a
        waiting request whose client left never takes a batch slot. GETs (health, metrics) are not watched,
        as in vLLM, and cost no extra task."""
        if req.method != "POST":
            await self.respond(await handler(req))
            return True
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_hangup, nursery.cancel_scope)
                await self.respond(await handler(req))
                nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError) as group:
            log.debug("connection ended: %r", group.exceptions[0])
            self.hung_up = True
        return not self.hung_up

    async def _watch_hangup(self, scope: trio.CancelScope) -> None:
        """Read (and keep for h11's next cycle) whatever the client sends during the exchange; at EOF or a reset
        cancel ``scope`` (raising from here would reach the nursery as a group no handler above expects). Past
        ``RECV`` buffered bytes it stops reading, as uvicorn pauses a pipelining client: the rest waits in the
        socket, and memory stays bounded."""
        try:
            while len(self.h11.trailing_data[0]) < RECV:
                data = await self.stream.receive_some(RECV)
                if not data:
                    break
                self.h11.receive_data(data)
            else:
                return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.hung_up = True
        scope.cancel()

    async def respond(self, resp: HttpResponse) -> None:
        headers = [
            (b"date", _date.get()),
            (b"server", b"uvicorn"),
            (b"content-type", resp.content_type.encode()),
        ]
        headers += [(k.encode(), v.encode()) for k, v in resp.headers]
        if resp.stream is None:
            headers.append((b"content-length", str(len(resp.body)).encode()))
            data = self.h11.send(h11.Response(status_code=resp.status, headers=headers)) or b""
            if resp.body:
                data += self.h11.send(h11.Data(data=resp.body)) or b""
            data += self.h11.send(h11.EndOfMessage()) or b""
            await self.stream.send_all(data)
            return
        await self.send(h11.Response(status_code=resp.status, headers=headers))
        async with aclosing(resp.stream) as chunks:
            async for chunk in chunks:
                await self.send(h11.Data(data=chunk))
        await self.send(h11.EndOfMessage())


def _reset_on_close(stream: trio.SocketStream) -> None:
    """Make the coming close send a TCP reset, as closing with unread bytes does in uvicorn's case."""
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def _error(conn: _Conn, status: int) -> None:
    if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
        body = b'{"error":{"message":"malformed HTTP request","type":"BadRequestError","param":null,"code":400}}'
        try:
            await conn.respond(HttpResponse(status, body))
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
            return


async def serve_connection(stream: trio.SocketStream, handler: Handler, keep_alive_s: float,
                           close_race_s: float = 0.0) -> None:
    """Serve requests on one connection until the peer, the protocol or the keep-alive timer closes it."""
    conn = _Conn(stream, keep_alive_s, close_race_s)
    try:
        while True:
            try:
                req = await conn.read_request()
            except h11.RemoteProtocolError as exc:
                await _error(conn, exc.error_status_hint)
                return
            if req is None:
                return
            if not await conn.answer(handler, req):
                return
            if conn.h11.our_state is h11.MUST_CLOSE or conn.h11.their_state is h11.MUST_CLOSE:
                return
            conn.h11.start_next_cycle()
            conn.served += 1
            conn.idle_since = trio.current_time()
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError) as exc:
        log.debug("connection ended: %r", exc)
    finally:
        await stream.aclose()


async def serve_http(
    listeners: list[trio.SocketListener], handler: Handler, keep_alive_s: float = 5.0, close_race_s: float = 0.0
) -> None:
    """Accept connections on already-open listeners until cancelled."""

    async def on_connection(stream: trio.SocketStream) -> None:
        await serve_connection(stream, handler, keep_alive_s, close_race_s)

    await trio.serve_listeners(on_connection, listeners)
