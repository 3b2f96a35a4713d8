"""Shared dispatch entries: packed per engine and expiry bucket, flushed in batches, parsed defensively,
swept when expired, and bounded whatever the traffic; shared placements (prefix homes) likewise."""

import pytest
import trio
from mesh_node_helpers import settings

from gateway.mesh_link import PLACEMENT_FLUSH_S, run_mesh_tasks, share_placements
from gateway.mesh_state import (
    MAX_BUCKET_KEYS,
    MAX_PLACEMENTS,
    NAMESPACES,
    PLACEMENT_SLOTS,
    MeshState,
    pack_dispatch,
    parse_dispatch,
    parse_placements,
)
from mesh.node import MeshNode
from mesh.sync_protocol import SyncProtocol


def state(name: str) -> MeshState:
    """The router's replicated state on a node that is built but not running (no sockets needed)."""
    return MeshState(MeshNode(settings(name), NAMESPACES))


def test_publish_adds_only_new_or_stale_blocks_and_sweep_removes_expired_buckets():
    a = state("a")
    assert a.publish_dispatch("e1", [1, 2, 3], now=0.0, ttl_s=100.0) == 3
    assert a.publish_dispatch("e1", [1, 2, 3, 4], now=10.0, ttl_s=100.0) == 1
    assert a.flush_dispatches(now=10.0) == 2  # two buckets: expiring at 100 and at 125
    assert a.publish_dispatch("e1", [1, 2], now=60.0, ttl_s=100.0) == 2  # their entries expire in < 50 s
    assert a.flush_dispatches(now=60.0) == 1
    assert a.sweep_dispatches(now=105.0) == 1
    assert a.sweep_dispatches(now=250.0) == 2
    assert a.content["approx"] == {}


def test_dispatch_buckets_replicate_to_a_peer_and_reach_its_callback():
    a, b = state("a"), state("b")
    seen = []
    b.on_dispatch(lambda engine, own_keys, expires: seen.append((engine, sorted(own_keys), expires)))
    a.publish_dispatch("e1", [7, 8, 2**64 - 1], now=0.0, ttl_s=300.0)
    a.flush_dispatches(now=0.0)
    SyncProtocol(b.node.doc).on_frame(a.node.protocol.update_frame(), 0.0)
    assert seen == [("e1", [7, 8, 2**64 - 1], 300.0)]


def test_the_document_stays_small_at_the_dispatch_volume_that_passed_16_mib():
    """~280k blocks dispatched within one TTL took the document, one key per block, past 16 MiB."""
    a = state("a")
    for request in range(2_800):
        a.publish_dispatch(f"e{request % 16}", range(request * 100, (request + 1) * 100), now=request * 0.01,
                           ttl_s=600.0)
        if request % 25 == 0:
            a.flush_dispatches(now=request * 0.01)
    a.flush_dispatches(now=30.0)
    assert len(a.content["approx"]) <= 2 * 16  # at most two expiry buckets per engine in 30 s
    assert a.node.doc.encoded_size() < 16 * 16 * 1024  # a bucket is at most 11 KB, whatever the traffic
    assert a.node.doc.encoded_size() > 16 * MAX_BUCKET_KEYS * 8


def test_malformed_entries_are_refused():
    good = pack_dispatch([5], 1.0)
    assert parse_dispatch("e1\x1fr\x1f3", good) == ("e1", [5], 1.0)
    assert parse_dispatch("e1\x1fr\x1f3", "1.0:not base64!") is None
    assert parse_dispatch("e1\x1fr\x1f3", "soon:" + good.partition(":")[2]) is None
    assert parse_dispatch("no-separator", good) is None
    assert parse_dispatch("e1\x1fr\x1f3", None) is None
    assert parse_dispatch("e1\x1fr\x1f3", "nan:" + good.partition(":")[2]) is None
    assert parse_dispatch("e1\x1fr\x1f3", "1.0:AAAA") is None  # not whole u64 words
    assert parse_dispatch("e1\x1fr\x1f3", pack_dispatch(range(MAX_BUCKET_KEYS + 1), 1.0)) is None


def test_placements_reach_every_peer_once_and_departed_replicas_are_swept():
    a, b = state("a"), state("b")
    seen = []
    b.on_placements(lambda replica, placements: seen.append((replica, placements)))
    a.publish_placement(("home-1", "e1", 40, 800, "9f0c", 30))
    a.publish_placement(("home-2", "e2", 3, None, "", 0))
    assert a.flush_placements() == 1 and a.flush_placements() == 0  # nothing new: no write
    frame = a.node.protocol.update_frame()
    SyncProtocol(b.node.doc).on_frame(frame, 0.0)
    SyncProtocol(b.node.doc).on_frame(frame, 0.0)
    assert seen == [(a.node.member_id, [("home-1", "e1", 40, 800, "9f0c", 30), ("home-2", "e2", 3, None, "", 0)])]
    a.publish_placement(("home-1", "e3", 40, 800, "", 0))
    a.flush_placements()
    SyncProtocol(b.node.doc).on_frame(a.node.protocol.update_frame(), 0.0)
    assert seen[-1] == (a.node.member_id, [("home-1", "e3", 40, 800, "", 0)]) and len(seen) == 2
    assert b.sweep_placements([b.node.member_id]) == 2 and b.content["homes"] == {}  # both slots a wrote


def test_writes_closer_together_than_broadcasts_reach_a_peer_each_once():
    """A peer sees only a key's latest value: with one key per replica, the second of two writes between two
    broadcasts hid the first. Writes rotate through PLACEMENT_SLOTS keys, so each arrives, in whatever order the
    broadcast lists them, once however often the frames repeat; a snapshot of the slots applies nothing twice."""
    a, b = state("a"), state("b")
    seen = []
    b.on_placements(lambda replica, placements: seen.append(placements[0][0]))
    for n in range(3):
        a.publish_placement((f"home-{n}", "e1", 4, 800, "", 0))
        assert a.flush_placements() == 1
    frame = a.node.protocol.update_frame()
    for _ in range(2):
        SyncProtocol(b.node.doc).on_frame(frame, 0.0)
    assert sorted(seen) == ["home-0", "home-1", "home-2"]
    for n in range(3, 3 + 2 * PLACEMENT_SLOTS):
        a.publish_placement((f"home-{n}", "e1", 4, 800, "", 0))
        a.flush_placements()
        SyncProtocol(b.node.doc).on_frame(a.node.protocol.update_frame(), 0.0)
    assert sorted(seen) == sorted(f"home-{n}" for n in range(3 + 2 * PLACEMENT_SLOTS))
    assert len(a.content["homes"]) == PLACEMENT_SLOTS  # the slots are rewritten, not added to
    late = state("late")  # joins now: the slots' values are the last eight writes, each applied once
    late_seen = []
    late.on_placements(lambda replica, placements: late_seen.append(placements[0][0]))
    for _ in range(2):
        late.node.doc.apply_update(a.node.doc.full_update())
    assert len(late_seen) == PLACEMENT_SLOTS == len(set(late_seen))


def test_a_peer_of_the_version_before_writes_its_placements_under_its_id_alone():
    b = state("b")
    seen = []
    b.on_placements(lambda replica, placements: seen.append((replica, placements)))
    b.node.write([("homes", "old-peer", '1:[["k","e1",2,16]]')])
    b.node.write([("homes", "old-peer", '2:[["k","e2",2,16]]')])
    assert seen == [("old-peer", [("k", "e1", 2, 16, "", 0)]), ("old-peer", [("k", "e2", 2, 16, "", 0)])]
    assert b.sweep_placements([b.node.member_id]) == 1


async def test_a_placement_is_written_a_moment_after_it_is_made_and_the_writer_sleeps_meanwhile(autojump_clock):
    a = state("a")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(share_placements, a)
        await trio.sleep(1.0)
        assert a.content["homes"] == {}
        began = trio.current_time()
        a.publish_placement(("home-1", "e1", 4, 800, "", 0))
        a.publish_placement(("home-2", "e1", 4, 800, "", 0))  # one write for both
        while not a.content["homes"]:
            await trio.sleep(0.001)
        assert trio.current_time() - began == pytest.approx(PLACEMENT_FLUSH_S, abs=0.002)
        [(_, text)] = a.content["homes"].items()
        assert [p[0] for p in parse_placements(text)[1]] == ["home-1", "home-2"]
        nursery.cancel_scope.cancel()
    assert a.on_placement_due is None


async def test_a_failing_write_is_counted_logged_once_and_the_task_goes_on(autojump_clock, caplog):
    """Whatever a mesh-writing task raises ends neither the task nor the router: counted by task and reason,
    logged once per episode, and the task started again after a backoff."""
    a = state("a")
    write, failures = a.node.write, []

    def refusing_twice(ops):
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("document refused the write")
        return write(ops)

    a.node.write = refusing_twice
    with caplog.at_level("ERROR", logger="kvmesh.mesh"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_mesh_tasks, a)
            for n in range(3):
                await trio.sleep(1.0)
                a.publish_placement((f"home-{n}", "e1", 4, 800, "", 0))
            await trio.sleep(1.0)
            nursery.cancel_scope.cancel()
    assert a.task_failures == {("placement sharing", "RuntimeError"): 2}
    from prometheus_client import CollectorRegistry

    from gateway.mesh_metrics import MeshCollector

    registry = CollectorRegistry()
    registry.register(MeshCollector(a.node, a))
    assert registry.get_sample_value("kvmesh_mesh_task_failures_total",
                                     {"task": "placement sharing", "reason": "RuntimeError"}) == 2
    assert [r.getMessage() for r in caplog.records] == ["mesh task failed; retrying with backoff"]
    [(_, text)] = a.content["homes"].items()
    assert parse_placements(text)[1] == [("home-2", "e1", 4, 800, "", 0)]


def test_placements_are_bounded_per_write_and_malformed_ones_refused_whole():
    a = state("a")
    for i in range(MAX_PLACEMENTS + 5):
        a.publish_placement((f"k{i}", "e1", 1, None, "", 0))
    assert a.placements_dropped == 5 and a.flush_placements() == 1
    [text] = a.content["homes"].values()
    assert parse_placements(text)[1][-1] == (
        f"k{MAX_PLACEMENTS - 1}", "e1", 1, None, "", 0)
    assert parse_placements('3:[["k","e1",2,16]]') == (3, [("k", "e1", 2, 16, "", 0)])  # a peer of the version before
    assert parse_placements('3:[["k","e1",2,16,"ab12",2]]') == (3, [("k", "e1", 2, 16, "ab12", 2)])
    for bad in ['x:[["k","e1",2,16]]', '3:[["k","e1",0,16]]', '3:[["k","e1",2,true]]', '3:[["k","e\x1f1",2,16]]',
                '3:[["","e1",2,16]]', '3:{"k":1}', '3:[["k","e1",2]]', "3:" + "[" * 5000, None,
                '3:[["' + "k" * 200 + '","e1",2,16]]', '-1:[["k","e1",2,16]]', '3:[["k","e1",2,16,"s"]]',
                '3:[["k","e1",2,16,7,2]]', '3:[["k","e1",2,16,"s",-1]]', '3:[["k","e1",2,16,"' + "s" * 200 + '",2]]']:
        assert parse_placements(bad) is None, bad
    b = state("b")
    b.on_placements(lambda replica, placements: pytest.fail("a malformed write reached the callback"))
    b.node.write([("homes", "peer", '1:[["k","e1",-4,16]]')])
    assert b.malformed["homes"] == 1


def test_refused_and_dropped_mesh_state_is_counted_on_a_scrape():
    """What the mesh refuses (malformed frames and values) or drops (full writes) shows on /metrics."""
    from prometheus_client import CollectorRegistry

    from gateway.mesh_metrics import MeshCollector

    a = state("a")
    registry = CollectorRegistry()
    registry.register(MeshCollector(a.node, a))

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("kvmesh_mesh_events_total", layer="protocol", event="malformed") is None
    assert sample("kvmesh_mesh_values_rejected_total", namespace="document") == 0
    assert a.node.protocol.on_frame(b"\xc1 not msgpack", 0.0) == []
    a.node.write([("homes", "peer", '1:[["k","e1",-4,16]]')])
    for i in range(MAX_PLACEMENTS + 3):
        a.publish_placement((f"k{i}", "e1", 1, None, "", 0))
    assert sample("kvmesh_mesh_events_total", layer="protocol", event="malformed") == 1
    assert sample("kvmesh_mesh_values_rejected_total", namespace="homes") == 1
    assert sample("kvmesh_mesh_writes_dropped_total", kind="placements") == 3
    assert sample("kvmesh_mesh_writes_dropped_total", kind="dispatch") == 0
