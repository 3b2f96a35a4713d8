"""Shared dispatch entries: written once per half TTL, parsed defensively, swept when expired."""

from mesh_node_helpers import settings

from gateway.mesh_state import NAMESPACES, MeshState, parse_dispatch
from mesh.node import MeshNode
from mesh.sync_protocol import SyncProtocol


def state(name: str) -> MeshState:
    """The router's replicated state on a node that is built but not running (no sockets needed)."""
    return MeshState(MeshNode(settings(name), NAMESPACES))


def test_publish_writes_only_new_or_stale_keys_and_sweep_removes_expired():
    a = state("a")
    assert a.publish_dispatch("e1", [1, 2, 3], expires_at=100.0, refresh_before=50.0) == 3
    assert a.publish_dispatch("e1", [1, 2, 3, 4], expires_at=110.0, refresh_before=60.0) == 1
    assert a.publish_dispatch("e1", [1, 2], expires_at=200.0, refresh_before=150.0) == 2
    assert a.sweep_dispatches(now=105.0) == 1
    assert a.sweep_dispatches(now=250.0) == 3
    assert a.content["approx"] == {}


def test_dispatch_entries_replicate_to_a_peer_and_reach_its_callback():
    a, b = state("a"), state("b")
    seen = []
    b.on_dispatch(lambda engine, own_key, expires: seen.append((engine, own_key, expires)))
    a.publish_dispatch("e1", [7, 8], expires_at=300.0, refresh_before=0.0)
    SyncProtocol(b.node.doc).on_frame(a.node.protocol.update_frame(), 0.0)
    assert sorted(seen) == [("e1", 7, 300.0), ("e1", 8, 300.0)]


def test_malformed_entries_are_refused():
    assert parse_dispatch("e1\x1fnot-a-number", "1.0") is None
    assert parse_dispatch("e1\x1f5", "soon") is None
    assert parse_dispatch("no-separator", "1.0") is None
    assert parse_dispatch("e1\x1f5", None) is None
    assert parse_dispatch("e1\x1f" + "9" * 5000, "1.0") is None
    assert parse_dispatch("e1\x1f5", "nan") is None
    assert parse_dispatch("e1\x1f-5", "1.0") is None
