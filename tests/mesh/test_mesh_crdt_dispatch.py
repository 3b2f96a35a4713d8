"""Shared dispatch entries: written once per half TTL, parsed defensively, swept when expired."""

from index.replicated import ReplicatedIndex, parse_dispatch

from mesh.sync_protocol import SyncProtocol


def test_publish_writes_only_new_or_stale_keys_and_sweep_removes_expired():
    index = ReplicatedIndex("a")
    assert index.publish_dispatch("e1", [1, 2, 3], expires_at=100.0, refresh_before=50.0) == 3
    assert index.publish_dispatch("e1", [1, 2, 3, 4], expires_at=110.0, refresh_before=60.0) == 1
    assert index.publish_dispatch("e1", [1, 2], expires_at=200.0, refresh_before=150.0) == 2
    assert index.sweep_dispatches(now=105.0) == 1
    assert index.sweep_dispatches(now=250.0) == 3
    assert index.doc.content["approx"] == {}


def test_dispatch_entries_replicate_to_a_peer():
    a, b = ReplicatedIndex("a"), ReplicatedIndex("b")
    pa, pb = SyncProtocol(a.doc), SyncProtocol(b.doc)
    a.publish_dispatch("e1", [7, 8], expires_at=300.0, refresh_before=0.0)
    for frame in [pa.update_frame()]:
        pb.on_frame(frame, 0.0)
    seen = sorted(parse_dispatch(k, v) for k, v in b.doc.content["approx"].items())
    assert seen == [("e1", 7, 300.0), ("e1", 8, 300.0)]


def test_malformed_entries_are_refused():
    assert parse_dispatch("e1\x1fnot-a-number", "1.0") is None
    assert parse_dispatch("e1\x1f5", "soon") is None
    assert parse_dispatch("no-separator", "1.0") is None
    assert parse_dispatch("e1\x1f5", None) is None
