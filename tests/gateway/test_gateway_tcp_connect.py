"""Engine connections by address: an IP literal is connected directly (no name lookup, no tasks of their own),
a name through trio's lookup, and a refused connect is an ``UpstreamError`` that leaves no socket open."""

from __future__ import annotations

import os
import socket

import pytest
import trio

from gateway.upstream import EnginePool, UpstreamError
from sim.http_server import HttpRequest, HttpResponse, serve_http


class _Spawns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.names.append(task.name)


async def _engine(nursery, host: str) -> int:
    async def ok(req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b'{"ok":true}')

    listeners = await trio.open_tcp_listeners(0, host=host)
    nursery.start_soon(serve_http, listeners, ok)
    return listeners[0].socket.getsockname()[1]


async def _status(pool: EnginePool) -> int:
    response = await pool.request("POST", "/v1/x", b"{}")
    try:
        await response.read(5)
        return response.status
    finally:
        await response.aclose()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host, url_host", [("127.0.0.1", "127.0.0.1"), pytest.param(
    "::1", "[::1]", marks=pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback"))])
async def test_an_engine_named_by_ip_literal_is_connected_without_a_task_of_its_own(nursery, host, url_host):
    port = await _engine(nursery, host)
    pool = EnginePool(f"http://{url_host}:{port}")
    spawns = _Spawns()
    trio.lowlevel.add_instrument(spawns)
    try:
        assert await _status(pool) == 200
    finally:
        trio.lowlevel.remove_instrument(spawns)
    assert pool.idle_connections == 1
    # trio.open_tcp_stream races its attempts in tasks of its own (the engine's server spawns its handler)
    assert [name for name in spawns.names if "open_tcp_stream" in name] == []
    await pool.aclose()


async def test_an_engine_named_by_host_name_is_still_looked_up(nursery):
    port = await _engine(nursery, "127.0.0.1")
    pool = EnginePool(f"http://localhost:{port}")
    assert await _status(pool) == 200
    await pool.aclose()


async def test_a_refused_connect_is_an_upstream_error_and_leaves_no_socket_open():
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        port = spare.getsockname()[1]  # bound, never listening: connects are refused
        before = len(os.listdir("/proc/self/fd"))
        pool = EnginePool(f"http://127.0.0.1:{port}")
        for _ in range(5):
            with pytest.raises(UpstreamError, match="cannot connect"):
                await _status(pool)
        assert len(os.listdir("/proc/self/fd")) == before
