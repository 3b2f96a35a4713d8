"""An engine read on a plain socket waits first and reads after, and ends when its idle timeout passes: the
run's stall watch, not a cancel scope per read, wakes it. Real socket pairs, trio's autojump clock."""

from __future__ import annotations

import pytest
import trio
from prometheus_client import REGISTRY

from gateway.stall_watch import stall_watch
from gateway.upstream import STALLED, UpstreamError, _close_quietly, _Connection


async def _pair() -> tuple[_Connection, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return _Connection(trio.SocketStream(a)), trio.SocketStream(b)


async def test_a_read_returns_what_the_engine_sent_and_leaves_no_wait_behind(autojump_clock):
    connection, engine = await _pair()
    assert connection.fd is not None

    async def send_later() -> None:
        await trio.sleep(1)
        await engine.send_all(b"data: 1\n\n")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_later)
        assert await connection.receive(5) == b"data: 1\n\n"
    assert not stall_watch().waits
    await engine.aclose()
    assert await connection.receive(5) == b""  # the engine closed: end of stream, not a stall


async def test_a_read_with_nothing_sent_stalls_at_its_own_deadline(autojump_clock):
    """Two reads wait at once, the later one with the shorter timeout: each ends at its own deadline (the
    watch's sleep moves forward for the shorter one), and the long one still gets its data."""
    slow, slow_engine = await _pair()
    quick, _quick_engine = await _pair()
    ended: dict[str, float] = {}
    start = trio.current_time()

    async def read_slow() -> None:
        assert await slow.receive(10) == b"late"
        ended["slow"] = trio.current_time() - start

    async def read_quick() -> None:
        with pytest.raises(UpstreamError, match=STALLED):
            await quick.receive(2)
        ended["quick"] = trio.current_time() - start

    async def send_late() -> None:
        await trio.sleep(6)
        await slow_engine.send_all(b"late")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_slow)
        await trio.sleep(0.5)
        nursery.start_soon(read_quick)
        nursery.start_soon(send_late)
    assert ended["quick"] == pytest.approx(2.5, abs=0.01)
    assert ended["slow"] == pytest.approx(6.5, abs=0.01)
    assert not stall_watch().waits


async def test_a_cancelled_read_leaves_no_wait_and_a_later_read_still_stalls(autojump_clock):
    connection, _engine = await _pair()
    with trio.move_on_after(1):
        await connection.receive(100)
    assert not stall_watch().waits
    with pytest.raises(UpstreamError, match=STALLED):
        await connection.receive(3)


async def test_a_stream_that_is_not_a_plain_socket_reads_in_a_scope(autojump_clock):
    """A stream the caller supplied (here a memory pair): no descriptor to wait on, the same errors."""
    left, right = trio.testing.memory_stream_pair()
    connection = _Connection(left)
    assert connection.fd is None
    with pytest.raises(UpstreamError, match=STALLED):
        await connection.receive(3)
    await right.send_all(b"x")
    assert await connection.receive(3) == b"x"


def _stalls() -> float:
    return REGISTRY.get_sample_value("kvmesh_upstream_stall_watch_total", {"outcome": "stalled"}) or 0.0


async def test_a_stall_is_counted(autojump_clock):
    connection, _engine = await _pair()
    before = _stalls()
    with pytest.raises(UpstreamError, match=STALLED):
        await connection.receive(1)
    assert _stalls() == before + 1


async def test_a_closed_connection_reads_and_writes_no_descriptor_again():
    """Its descriptor number may belong to another socket by then: reads and writes go through the closed
    stream, which refuses them."""
    connection, _engine = await _pair()
    await _close_quietly(connection)
    assert connection.fd is None
    with pytest.raises(trio.ClosedResourceError):
        await connection.receive(1)
    with pytest.raises(trio.ClosedResourceError):
        await connection.send_all()
