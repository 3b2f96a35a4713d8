"""Replication over real TCP on loopback: replicas in one trio process."""

from __future__ import annotations

from collections.abc import Callable

import trio
from doc_replica import Replica

from mesh.sync import SyncService
from mesh.sync_protocol import SyncProtocol

SECRET = b"kvmesh-test-secret-0123456789"


class Mesh:
    """Replicas that see each other through a shared address book (what gossip would provide)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.addresses: dict[str, tuple[str, int]] = {}
        self.indexes: dict[str, Replica] = {}
        self.services: dict[str, SyncService] = {}
        self.cut: set[frozenset[str]] = set()

    async def add(self, replica_id: str, secret: bytes = SECRET) -> Replica:
        index = Replica(replica_id)
        service = SyncService(
            SyncProtocol(index.doc),
            secret,
            lambda: self.addresses,
            anti_entropy_interval=0.2,
            drop=lambda peer: frozenset((replica_id, peer)) in self.cut,
        )
        port = await self.nursery.start(service.run)
        self.addresses[replica_id] = ("127.0.0.1", port)
        self.indexes[replica_id] = index
        self.services[replica_id] = service
        return index


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


def converged(mesh: Mesh) -> bool:
    views = [index.doc.content for index in mesh.indexes.values()]
    return all(view == views[0] for view in views)


async def test_mesh_sync_three_replicas_converge() -> None:
    async with trio.open_nursery() as nursery:
        mesh = Mesh(nursery)
        for name in ("a", "b", "c"):
            await mesh.add(name)
        for name, index in mesh.indexes.items():
            index.store(f"engine-{name}", [(h, h * 3) for h in range(500)])
            index.set_registry(f"engine-{name}", {"island": name})
        mesh.indexes["b"].remove("engine-b", range(100))
        await wait_until(lambda: converged(mesh) and len(mesh.indexes["a"].engines()) == 3)
        for index in mesh.indexes.values():
            assert index.block_count("engine-b") == 400
            assert index.pairs("engine-c") == {h: h * 3 for h in range(500)}
            assert index.registry()["engine-a"] == {"island": "a"}
        nursery.cancel_scope.cancel()


async def test_mesh_sync_new_replica_is_warm_within_two_seconds() -> None:
    async with trio.open_nursery() as nursery:
        mesh = Mesh(nursery)
        a, b = await mesh.add("a"), await mesh.add("b")
        for engine_number in range(2):
            for start in range(0, 5000, 100):
                a.store(f"ea{engine_number}", [(h, h) for h in range(start, start + 100)])
                b.store(f"eb{engine_number}", [(h, h) for h in range(start, start + 100)])
        await wait_until(lambda: converged(mesh))
        total = len(a.doc.content["pairs"])
        assert total == 20_000
        started = trio.current_time()
        newcomer = await mesh.add("c")
        await wait_until(lambda: len(newcomer.doc.content["pairs"]) >= 0.99 * total, timeout=2.0)
        assert trio.current_time() - started < 2.0
        assert sum(newcomer.block_count(e) for e in newcomer.engines()) >= 0.99 * total
        nursery.cancel_scope.cancel()


async def test_mesh_sync_wrong_secret_is_refused() -> None:
    async with trio.open_nursery() as nursery:
        mesh = Mesh(nursery)
        a = await mesh.add("a")
        a.store("ea", [(1, 1)])
        intruder = await mesh.add("x", secret=b"some-other-secret-0123456789")
        intruder.store("ex", [(2, 2)])
        await wait_until(lambda: mesh.services["a"].auth.failures["mac"] >= 1)
        await wait_until(lambda: mesh.services["x"].auth.failures["mac"] >= 1)
        await trio.sleep(0.3)
        assert intruder.engines() == ["ex"]
        assert a.engines() == ["ea"]
        nursery.cancel_scope.cancel()


async def test_mesh_sync_partition_heals_and_converges() -> None:
    async with trio.open_nursery() as nursery:
        mesh = Mesh(nursery)
        a, b, c = await mesh.add("a"), await mesh.add("b"), await mesh.add("c")
        mesh.cut = {frozenset(("a", "c")), frozenset(("b", "c"))}
        a.store("ea", [(1, 10)])
        c.store("ec", [(2, 20)])
        await wait_until(lambda: b.pairs("ea") == {1: 10})
        await trio.sleep(0.5)  # several flushes and anti-entropy rounds; the filter must hold them back
        assert c.pairs("ea") == {} and a.pairs("ec") == {} and b.pairs("ec") == {}
        assert mesh.services["c"].counters["dropped_by_filter"] > 0
        mesh.cut = set()
        await wait_until(lambda: converged(mesh) and a.pairs("ec") == {2: 20} and c.pairs("ea") == {1: 10})
        nursery.cancel_scope.cancel()


async def test_mesh_sync_unauthenticated_connections_cost_little_and_are_closed() -> None:
    """A stranger announcing a 16 MiB frame is cut at the header; one that says nothing is cut after the
    hello deadline; replication between real replicas goes on meanwhile."""
    from mesh import sync

    async with trio.open_nursery() as nursery:
        mesh = Mesh(nursery)
        a = await mesh.add("a")
        service = mesh.services["a"]
        big = await trio.open_tcp_stream(*mesh.addresses["a"])
        await big.send_all((16 * 1024 * 1024).to_bytes(4, "big"))
        assert await big.receive_some(10) == b""  # closed: the first frame may be 64 KiB at most
        silent = await trio.open_tcp_stream(*mesh.addresses["a"])
        with trio.fail_after(sync.HELLO_TIMEOUT_S + 3):
            assert await silent.receive_some(10) == b""
        assert service.counters["closed_FrameError"] == 1
        assert service.counters["closed_TooSlowError"] == 1
        b = await mesh.add("b")
        a.set_registry("e", {"island": "x"})
        await wait_until(lambda: b.registry() == {"e": {"island": "x"}})
        nursery.cancel_scope.cancel()


async def test_mesh_sync_hello_has_one_deadline_not_one_per_read() -> None:
    """A stranger trickling its first frame a byte every 0.5 s is closed HELLO_TIMEOUT_S after it connected.
    Before, the hello timeout applied to each read: a byte every 1.9 s kept the connection forever."""
    from mesh import sync

    async with trio.open_nursery() as nursery:
        mesh = Mesh(nursery)
        await mesh.add("a")
        trickler = await trio.open_tcp_stream(*mesh.addresses["a"])
        opened = trio.current_time()
        await trickler.send_all((1000).to_bytes(4, "big"))
        with trio.fail_after(sync.HELLO_TIMEOUT_S + 3):
            while True:
                try:
                    with trio.move_on_after(0.5):
                        if await trickler.receive_some(10) == b"":
                            break
                    await trickler.send_all(b"x")
                except trio.BrokenResourceError:  # closed with our unread bytes in its buffer: a reset
                    break
        assert trio.current_time() - opened < sync.HELLO_TIMEOUT_S + 1
        assert mesh.services["a"].counters["closed_TooSlowError"] == 1
        nursery.cancel_scope.cancel()
