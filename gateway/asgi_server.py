"""A lean HTTP/1.1 server for an ASGI application: h11 over trio, one task per connection, the application
run inside that task.

Why not Hypercorn: with the router alone on a core and the engine's tokens arriving for every stream at
once (one decode step), each relayed chunk waits behind every other stream's chunk at each scheduler pass
it takes. Hypercorn takes several: the application's ``send`` goes through its stream and protocol
objects to a per-connection lock (a checkpoint) and ``send_all`` (another), the request body reaches the
application through a task of its own and a queue. Here a response chunk is written straight to the
socket (no checkpoint while the kernel takes the bytes, which on loopback it almost always does), the
head goes out with the first body chunk in one write, and the body the client already sent is handed to
the application from the connection's own buffer. The measured difference is in the README's performance
section.

What it implements of ASGI: the ``http`` scope (spec 2.3), no lifespan (the router has nothing to start
through it), no WebSocket, no HTTP/2. As with Hypercorn, a ``send`` to a client that has gone returns
quietly and ``receive`` then reports ``http.disconnect``. One extension (``HANGUP_EXTENSION``) reports a
client going away while the application waits on something else (an engine), without a task reading the
client's socket.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import logging
import select
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import h11
import trio

from gateway.socket_io import read_when_ready, write_through

log = logging.getLogger("kvmesh.http")
READ_SIZE = 65536
STREAM_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
App = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
               Awaitable[None]]
_NO_BODY_STATUS = frozenset({204, 304})
_CHUNKED_HEAD = b"\r\ntransfer-encoding: chunked\r\n"
"""In a response head h11 wrote (names lowered): its body is chunked, and the server frames the chunks itself:
h11's ``send(Data)`` cost 11 us a chunk here (a streamed answer is ~19 of them), the framing alone under 1 us.
h11 still writes the head and the final chunk, and keeps the exchange's state."""
HANGUP_EXTENSION = "kvmesh.hangup"
"""``scope["extensions"][HANGUP_EXTENSION](callback)`` is a context manager: while it is open, ``callback`` is
called (once, from another task; it must not block) if the client goes away, and the connection's sends are
dropped from then on. ``receive`` still reports ``http.disconnect`` for applications that read it."""


@dataclass(frozen=True)
class ServerSettings:
    """Where to listen and the limits of one connection (the router's come from ``gateway.server``)."""

    host: str
    port: int
    keep_alive_s: float = 75.0
    """How long a connection may wait for its next request (or for the rest of a request head)."""
    max_head_bytes: int = 64 * 1024
    """A request head larger than this is refused (431) before it is parsed."""
    graceful_s: float = 30.0
    """After the shutdown trigger: how long requests in flight may take before their connections are cut."""
    server_header: bytes = b"kvmesh"


@functools.lru_cache(maxsize=1)
def _http_date(second: int) -> bytes:
    """The Date header's value, formatted once per second."""
    return email.utils.formatdate(second, usegmt=True).encode()


class _Stopping:
    """Shared by every connection: whether the server stops, and the idle waits to end when it does."""

    def __init__(self) -> None:
        self.stopping = False
        self.idle: set[trio.CancelScope] = set()

    def stop(self) -> None:
        self.stopping = True
        for scope in self.idle:
            scope.cancel()


def _address(sockaddr: Any) -> tuple[str, int] | None:
    if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
        return str(sockaddr[0]), int(sockaddr[1])
    return None


class _Hangups:
    """Clients that go away while their requests are answered, for every connection of one server: watched
    sockets sit in one epoll set (``EPOLLRDHUP``: the peer closed its side or reset) that one task waits on.
    Waiting for a disconnect with a task per request (a nursery, a task reading the client's socket, its
    cancellation, two epoll registrations) cost ~150 us of CPU a request here; a watch in this set costs two
    system calls."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._callbacks: dict[int, Callable[[], None]] = {}

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        self._callbacks[fd] = callback
        try:
            self._epoll.register(fd, select.EPOLLRDHUP)
        except FileExistsError:  # a descriptor closed without unwatch and reused by the kernel
            self._epoll.modify(fd, select.EPOLLRDHUP)

    def unwatch(self, fd: int) -> None:
        if self._callbacks.pop(fd, None) is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)

    async def run(self) -> None:
        """Call each watched client's callback once its peer has gone; runs until cancelled."""
        try:
            while True:
                await trio.lowlevel.wait_readable(self._epoll.fileno())
                for fd, _ in self._epoll.poll(0):
                    callback = self._callbacks.get(fd)
                    self.unwatch(fd)
                    if callback is None:
                        continue
                    try:
                        callback()
                    except Exception:  # an application's bug must not end the watch of every other client
                        log.exception("a hangup callback failed")
        finally:
            trio.lowlevel.notify_closing(self._epoll.fileno())
            self._epoll.close()


class _HangupWatch:
    """The context manager behind ``HANGUP_EXTENSION`` for one connection."""

    __slots__ = ("hangups", "connection", "callback")

    def __init__(self, hangups: _Hangups, connection: _Connection, callback: Callable[[], None]) -> None:
        self.hangups = hangups
        self.connection = connection
        self.callback = callback

    def __enter__(self) -> None:
        connection = self.connection
        if connection.broken:  # already known gone (a read saw its end): no event would come
            self.callback()
            return
        self.hangups.watch(connection.fd, self._gone)

    def _gone(self) -> None:
        self.connection.broken = True
        self.callback()

    def __exit__(self, *exc_info: object) -> None:
        self.hangups.unwatch(self.connection.fd)


class _Connection:
    """One client connection: requests one after another (keep-alive), each answered by the application."""

    def __init__(self, stream: trio.SocketStream, app: App, settings: ServerSettings, stopping: _Stopping,
                 hangups: _Hangups | None) -> None:
        self.stream = stream
        self.fd = stream.socket.fileno()
        self.app = app
        self.settings = settings
        self.stopping = stopping
        self.hangups = hangups
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=settings.max_head_bytes)
        self.client = _address(stream.socket.getpeername())
        self.server = _address(stream.socket.getsockname())
        self.broken = False
        """The client is gone (a read saw EOF or an error, or a write failed): sends are dropped."""

    async def run(self) -> None:
        try:
            while not self.stopping.stopping:
                request = await self._next_request()
                if request is None:
                    return
                await _Exchange(self, request).run()
                if self.broken or self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                    return
                self.h11.start_next_cycle()
        except STREAM_ERRORS:
            return
        finally:
            await self._close()

    async def _next_request(self) -> h11.Request | None:
        """The next request head, or None when the connection is to end (closed, idle too long, stopping,
        or a malformed head, which is answered first)."""
        with trio.move_on_after(self.settings.keep_alive_s) as idle:
            self.stopping.idle.add(idle)
            try:
                while True:
                    try:
                        event = self.h11.next_event()
                    except h11.RemoteProtocolError as exc:
                        await self._refuse(exc.error_status_hint)
                        return None
                    if event is h11.NEED_DATA:
                        if self.stopping.stopping and not self.h11.trailing_data[0]:
                            return None
                        self.h11.receive_data(await read_when_ready(self.fd, READ_SIZE))
                        continue
                    return event if isinstance(event, h11.Request) else None
            finally:
                self.stopping.idle.discard(idle)
        return None

    async def _refuse(self, status: int) -> None:
        """Answer a request h11 could not parse; the connection then closes."""
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        headers = [(b"content-length", b"0"), (b"connection", b"close"), *self.own_headers()]
        try:
            await self.write(self.h11.send(h11.Response(status_code=status, headers=headers))
                             + (self.h11.send(h11.EndOfMessage()) or b""))
        except h11.LocalProtocolError:
            return

    def on_hangup(self, callback: Callable[[], None]) -> _HangupWatch:
        """``HANGUP_EXTENSION``: a context manager that calls ``callback`` if the client goes away within it."""
        assert self.hangups is not None  # offered only where the server watches hangups
        return _HangupWatch(self.hangups, self, callback)

    def own_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"date", _http_date(int(time.time()))), (b"server", self.settings.server_header)]

    async def write(self, data: bytes) -> None:
        """Write ``data`` to the client: straight into the socket when the kernel takes it all (no
        scheduler pass), else the rest through trio. A client that is gone makes this a no-op."""
        if self.broken or not data:
            return
        try:
            await write_through(self.fd, self.stream, data)
        except STREAM_ERRORS:
            self.broken = True

    async def _close(self) -> None:
        self.broken = True  # the descriptor number may be reused once closed: no write may reach it
        with trio.CancelScope(shield=True):
            with contextlib.suppress(STREAM_ERRORS):
                await self.stream.send_eof()
            await trio.aclose_forcefully(self.stream)


class _Exchange:
    """One request and its answer: the ASGI ``receive`` and ``send`` the application gets."""

    def __init__(self, connection: _Connection, request: h11.Request) -> None:
        self.connection = connection
        self.h11 = connection.h11
        self.method = request.method.decode("ascii")
        raw_path, _, query = request.target.partition(b"?")
        self.scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode("ascii"), "method": self.method.upper(), "scheme": "http",
            "path": unquote(raw_path.decode("ascii", "replace")), "raw_path": raw_path, "query_string": query,
            "root_path": "", "headers": list(request.headers), "client": connection.client,
            "server": connection.server,
            "extensions": {HANGUP_EXTENSION: connection.on_hangup} if connection.hangups is not None else {},
        }
        self.body_done = False
        self.head: h11.Response | None = None
        self.started = False
        self.complete = False
        self.no_body = False
        self.chunked = False

    async def run(self) -> None:
        try:
            await self.connection.app(self.scope, self.receive, self.send)
        except Exception:
            log.exception("the application failed", extra={"path": self.scope["path"]})
        if not self.started:
            await self._error_answer()
        elif not self.complete:
            self.connection.broken = True  # a half-sent answer: only closing the connection ends it

    async def receive(self) -> dict[str, Any]:
        """The request body as the client sends it, then (once it is all read) ``http.disconnect`` when the
        client goes away or the answer is complete."""
        connection = self.connection
        if not self.body_done and not connection.broken:
            if self.h11.they_are_waiting_for_100_continue:
                await connection.write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError:
                    connection.broken = True
                    break
                if event is h11.NEED_DATA:
                    data = await self._read()
                    if not data:
                        break
                    self.h11.receive_data(data)
                    continue
                if isinstance(event, h11.Data):
                    return {"type": "http.request", "body": bytes(event.data), "more_body": True}
                if isinstance(event, h11.EndOfMessage):
                    self.body_done = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                connection.broken = True
                break
            return {"type": "http.disconnect"}
        while not connection.broken and not self.complete:
            if len(self.h11.trailing_data[0]) > connection.settings.max_head_bytes:
                await trio.sleep_forever()  # a client that pipelines without bound: only a failed write tells
            data = await self._read()
            if not data:
                break
            self.h11.receive_data(data)  # a pipelined next request: kept for after this answer
        return {"type": "http.disconnect"}

    async def _read(self) -> bytes:
        """Bytes from the client; b"" (and the connection marked broken) once it is gone."""
        try:
            data = await read_when_ready(self.connection.fd, READ_SIZE)
        except STREAM_ERRORS:
            data = b""
        if not data:
            self.connection.broken = True
        return data

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            status = int(message["status"])
            self.head = h11.Response(status_code=status,  # a head h11 refuses raises here, before any byte
                                     headers=[*message.get("headers", []), *self.connection.own_headers()])
            self.started = True
            self.no_body = self.method == "HEAD" or status in _NO_BODY_STATUS
            return  # goes out with the first body message: one write for both
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started or self.complete:
            raise RuntimeError("http.response.body sent outside a response")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        out = []
        if self.head is not None:
            head = self.h11.send(self.head) or b""
            self.chunked = _CHUNKED_HEAD in head.lower()
            out.append(head)
            self.head = None
        if body and not self.no_body:
            chunk = b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else self.h11.send(h11.Data(data=body))
            out.append(chunk or b"")
        if not more:
            out.append(self.h11.send(h11.EndOfMessage()) or b"")
            self.complete = True
        await self.connection.write(out[0] if len(out) == 1 else b"".join(out))

    async def _error_answer(self) -> None:
        """The application ended without answering: a bare 500, and the connection closes."""
        self.started = True
        headers = [(b"content-length", b"0"), (b"connection", b"close"), *self.connection.own_headers()]
        try:
            data = self.h11.send(h11.Response(status_code=500, headers=headers)) or b""
            data += self.h11.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:
            self.connection.broken = True
            return
        self.complete = True
        await self.connection.write(data)


def _bind_url(listener: trio.SocketListener) -> str:
    host, port = listener.socket.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(app: App, settings: ServerSettings, shutdown_trigger: Callable[[], Awaitable[Any]],
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``settings.host:port`` until ``shutdown_trigger`` returns; then stop accepting, close
    idle connections, and give requests in flight ``graceful_s`` to finish. Started, it reports the URLs it
    listens on."""
    listeners = await trio.open_tcp_listeners(settings.port, host=settings.host)
    stopping = _Stopping()
    hangups = _Hangups() if hasattr(select, "epoll") else None  # Linux; elsewhere apps wait on receive

    async def on_connection(stream: trio.SocketStream) -> None:
        """Owns one connection: whatever goes wrong with it is logged and ends it, never the server."""
        try:
            connection = _Connection(stream, app, settings, stopping, hangups)
        except OSError:  # the client left before its address could be read
            await trio.aclose_forcefully(stream)
            return
        try:
            await connection.run()
        except Exception:
            log.exception("connection failed", extra={"client": connection.client})

    async with trio.open_nursery() as server:
        if hangups is not None:
            server.start_soon(hangups.run)
        async with trio.open_nursery() as connections:
            accepting = trio.CancelScope()

            async def accept() -> None:
                with accepting:
                    await trio.serve_listeners(on_connection, listeners, handler_nursery=connections)

            connections.start_soon(accept)
            task_status.started([_bind_url(listener) for listener in listeners])
            await shutdown_trigger()
            accepting.cancel()
            stopping.stop()
            connections.cancel_scope.deadline = trio.current_time() + settings.graceful_s
        server.cancel_scope.cancel()
