"""Plain sockets read and written without a scheduler pass trio's streams would spend.

Reads wait first, then read: trio's ``receive_some`` tries a read before it waits, which on a socket with
nothing in it yet is a failed system call and an exception each time. For the router that is the usual case on
both sides: an engine's next token, the engine's answer to a request just sent, a client's next request after
an answer. On a socket pair (a script outside the repository) a message cost 21.1-22.7 us read the trio way and
16.4-17.8 us waiting first (no timeout scope in either). Writes go straight into the socket when the kernel
takes them all, which on loopback it almost always does; only a rest goes through trio.

A connection to an address given as an IP literal (how engines are usually named) is one socket and one
``connect``: ``trio.open_tcp_stream`` resolves the name and races attempts in tasks of a nursery of its own
(happy eyeballs), which for a single address cost 330-346 us of CPU per connection against 115-135 us connected
directly (300 connections to a loopback listener each way, a script outside the repository). An opening burst
opens most of its engine connections at once, on the loop that plans the burst. Names still go through trio.
"""

from __future__ import annotations

import ipaddress
import os

import trio


async def read_when_ready(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes from ``fd`` once it is readable; b"" when the peer closed. Errors are the socket's
    (``OSError``), or trio's ``ClosedResourceError`` when the descriptor is closed under the wait."""
    while True:
        await trio.lowlevel.wait_readable(fd)
        try:
            return os.read(fd, size)
        except BlockingIOError:  # woken without data (rare): wait again
            continue


async def write_through(fd: int, stream: trio.abc.SendStream, data: bytes) -> None:
    """Write ``data`` to the socket ``fd`` of ``stream``: at once when the kernel takes it all, else the rest through
    ``stream`` (which waits for room). Errors are the socket's (``OSError``) or the stream's."""
    try:
        sent = os.write(fd, data)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        await stream.send_all(memoryview(data)[sent:])


async def open_tcp(host: str, port: int) -> trio.SocketStream:
    """A TCP stream to ``host``:``port``: connected directly when ``host`` is an IP literal, through
    ``trio.open_tcp_stream`` (name lookup, happy eyeballs) otherwise. Errors are ``OSError``."""
    try:
        family = trio.socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else trio.socket.AF_INET
    except ValueError:
        return await trio.open_tcp_stream(host, port)
    sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
    try:
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)
