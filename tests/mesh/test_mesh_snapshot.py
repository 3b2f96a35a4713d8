"""Redis snapshots: encoding (property tests), then nodes against a real redis-server that is killed."""

from __future__ import annotations

import pytest
import redis
import trio
from doc_replica import Replica
from hypothesis import given
from hypothesis import strategies as st
from mesh_node_helpers import free_port, settings, start_mesh, start_node, wait_until

from gateway.mesh_state import NAMESPACES, MeshState, parse_dispatch
from mesh.crdt_doc import Epoch
from mesh.node import MeshNode
from mesh.snapshots import KEY_PREFIX, Snapshot
from mesh.sync_protocol import SyncProtocol

uints = st.integers(min_value=0, max_value=2**53)
snapshots = st.builds(
    Snapshot,
    epoch=st.builds(Epoch, uints, st.text(max_size=20)),
    base_epoch=st.builds(Epoch, uints, st.text(max_size=20)),
    base=st.dictionaries(uints, uints, max_size=8),
    full=st.binary(max_size=64),
    writer=st.text(max_size=20),
    written_at=st.floats(min_value=0, max_value=2e9),
)


def as_stored(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    """What redis-py's HGETALL returns for a hash written with these fields."""
    return {key.encode(): value for key, value in fields.items()}


@given(snapshots)
def test_snapshot_fields_round_trip(snapshot):
    assert Snapshot.from_fields(as_stored(snapshot.to_fields())) == snapshot


@given(snapshots, st.sampled_from(["format", "epoch_number", "base", "epoch_owner"]), st.binary(max_size=8))
def test_damaged_snapshot_fields_raise_value_error(snapshot, field, garbage):
    stored = as_stored(snapshot.to_fields())
    del stored[field.encode()]
    with pytest.raises(ValueError):
        Snapshot.from_fields(stored)
    if field in ("format", "epoch_number", "base"):
        stored[field.encode()] = b"\xff\xff" + garbage
        with pytest.raises(ValueError):
            Snapshot.from_fields(stored)


def test_snapshot_of_a_document_restores_it_in_a_fresh_replica():
    source = Replica("a")
    source.store("engine-1", [(h, h * 7) for h in range(100)])
    source.set_registry("engine-1", {"island": "x"})
    snapshot = Snapshot.from_fields(as_stored(Snapshot.of(source.doc, 123.0).to_fields()))
    fresh = Replica("b")
    assert SyncProtocol(fresh.doc).load_snapshot(snapshot.epoch, snapshot.base_epoch, snapshot.base, snapshot.full)
    assert fresh.pairs("engine-1") == source.pairs("engine-1")
    assert fresh.registry() == {"engine-1": {"island": "x"}}


def stored_snapshot(url: str, cluster: str) -> Snapshot | None:
    client = redis.Redis.from_url(url, socket_timeout=0.5)
    try:
        fields = client.hgetall(KEY_PREFIX + cluster)
    finally:
        client.close()
    return Snapshot.from_fields(fields) if fields else None


def snapshot_holds(url: str, cluster: str, engine: str, dispatches: int) -> bool:
    snapshot = stored_snapshot(url, cluster)
    if snapshot is None:
        return False
    probe = MeshState(MeshNode(settings("probe"), NAMESPACES))
    probe.node.doc.apply_update(snapshot.full)
    return sum(len(parsed[1]) for key, text in probe.content["approx"].items()
               if (parsed := parse_dispatch(key, text)) is not None and parsed[0] == engine) == dispatches


@pytest.mark.integration
@pytest.mark.mesh
async def test_fresh_node_starts_warm_from_the_snapshot_after_the_whole_mesh_stopped(redis_server):
    url, _ = redis_server
    options = {"redis_url": url, "cluster": "warm", "snapshot_interval": 0.2}
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 2, **options)
        nodes[1].state.publish_dispatch("engine-1", range(500), now=4e9, ttl_s=600.0)
        nodes[1].state.flush_dispatches(now=4e9)
        nodes[0].state.set_registry("engine-1", {"drain": False})
        await wait_until(lambda: snapshot_holds(url, "warm", "engine-1", 500), 10)
        writers = {stored_snapshot(url, "warm").writer}
        assert writers == {min(r.node.member_id for r in nodes)}
        for r in nodes:
            r.crash()
    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        fresh = await start_node(nursery, settings("fresh", **options))
        warm_after = trio.current_time() - started
        print(f"fresh node warm after {warm_after:.3f}s")
        assert warm_after <= 2.0
        assert len(fresh.state.content["approx"]) == 1
        assert fresh.state.registry() == {"engine-1": {"drain": False}}
        assert fresh.node.stats["snapshot_loaded"] == 1
        nursery.cancel_scope.cancel()


@pytest.mark.integration
@pytest.mark.mesh
async def test_nodes_keep_replicating_when_redis_dies_and_count_the_errors(redis_server):
    url, process = redis_server
    async with trio.open_nursery() as nursery:
        nodes = await start_mesh(nursery, 3, redis_url=url, cluster="dies", snapshot_interval=0.1)
        nodes[0].state.set_registry("engine-1", {"island": "a"})
        await wait_until(lambda: stored_snapshot(url, "dies") is not None)
        process.kill()
        process.wait()
        writer = next(r for r in nodes if r.node.member_id == min(x.node.member_id for x in nodes))
        writer.state.set_registry("engine-2", {"island": "b"})
        await wait_until(lambda: all("engine-2" in r.state.registry() for r in nodes))
        await wait_until(lambda: writer.node.stats["snapshot_error"] >= 2)
        everyone = sorted(r.node.member_id for r in nodes)
        assert all(r.node.live_members() == everyone for r in nodes)
        assert writer.node.describe()["node"]["snapshot_error"] >= 2
        nursery.cancel_scope.cancel()


@pytest.mark.integration
async def test_unreachable_or_garbage_redis_never_stops_a_node_from_starting(redis_server):
    url, _ = redis_server
    client = redis.Redis.from_url(url, socket_timeout=0.5)
    client.hset(KEY_PREFIX + "garbage", mapping={"format": b"2", "epoch_number": b"x"})
    client.close()
    async with trio.open_nursery() as nursery:
        damaged = await start_node(nursery, settings("damaged", redis_url=url, cluster="garbage"))
        assert damaged.node.stats["snapshot_rejected_unsealed"] == 1  # garbage with no MAC: never parsed
        started = trio.current_time()
        dead_url = f"redis://127.0.0.1:{free_port()}/0"
        cold = await start_node(nursery, settings("cold", redis_url=dead_url))
        assert trio.current_time() - started <= 1.5
        assert cold.node.stats["snapshot_error"] == 1
        assert cold.node.live_members() == [cold.node.member_id]
        nursery.cancel_scope.cancel()
