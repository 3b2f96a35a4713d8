"""An engine added on one replica is the same engine on every other: the registry entry carries its whole
config (event endpoints, topic, model, block size, CURVE server key), checked like a configured engine. A
removed engine leaves neither a tombstone for ever nor metric series."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import trio
from router_inprocess import MODEL, call, make_router

from events.counters import ENGINE_TASK_FAILURES, EVENTS_DROPPED
from gateway.config import EngineConfig
from gateway.mesh_link import follow_mesh
from gateway.mesh_state import NAMESPACES, MeshState
from mesh.crdt_doc import ReplicatedDoc
from mesh.node import MeshNode
from mesh.settings import MeshSettings
from mesh.sync_protocol import SyncProtocol

SERVER_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"


class Recorder:
    """The writing side of gateway/mesh_state.py: keeps what the replica replicates."""

    def __init__(self) -> None:
        self.entries: dict[str, str] = {}

    def set_registry(self, engine: str, state: dict | None) -> None:
        self.entries[engine] = json.dumps(state, sort_keys=True)


class Feed:
    """The reading side: hands the router's registry callback a peer's entries."""

    def __init__(self) -> None:
        self.node = SimpleNamespace(share_load=lambda source: None, peer_in_flight=dict)
        self.malformed: Counter[str] = Counter()
        self.on_registry_change = None

    def on_registry(self, callback) -> None:
        self.on_registry_change = callback

    def set_registry(self, engine: str, state: dict | None) -> None:
        pass

    def on_dispatch(self, callback) -> None:
        pass

    def on_placements(self, callback) -> None:
        pass

    def publish_placement(self, placement) -> None:
        pass

    def registry(self) -> dict:
        return {}


async def test_an_engine_added_on_one_replica_keeps_its_events_and_curve_key_on_another():
    added = EngineConfig(url="http://127.0.0.1:9", id="added", model="m", events="tcp://127.0.0.1:5557",
                         replay="tcp://127.0.0.1:5558", topic="kv@added", island="rack-a", block_size=32,
                         curve_server_key=SERVER_KEY)
    first, second, feed, recorder = make_router(), make_router(), Feed(), Recorder()
    first.fleet.replicate = recorder.set_registry
    follow_mesh(second.fleet, feed)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first.fleet.run)  # where the engines' watchers run
        nursery.start_soon(second.fleet.run)
        first.fleet.add(added)
        entry = json.loads(recorder.entries["added"])
        feed.on_registry_change("added", entry)
        replica = second.engines.get("added")
        assert replica is not None and replica.config == added
        # an entry whose fields would not pass as configuration is refused, never half-added
        feed.on_registry_change("bad", {**entry, "curve_server_key": "not-a-key"})
        feed.on_registry_change("bad2", {**entry, "events": "http://x"})
        assert second.engines.get("bad") is None and second.engines.get("bad2") is None
        assert feed.malformed["registry"] == 2
        nursery.cancel_scope.cancel()


def test_tombstones_of_removed_engines_expire():
    """Autoscaler churn wrote one tombstone per engine ever removed, kept for ever in the document."""
    doc = ReplicatedDoc("a", NAMESPACES)
    state = MeshState(SimpleNamespace(doc=doc, write=doc.write, subscribe=doc.subscribe, member_id="a"))
    state.set_registry("live", {"url": "http://127.0.0.1:9"})
    state.set_registry("old", {"removed": True, "removed_at": 1000.0})
    state.set_registry("recent", {"removed": True, "removed_at": 5000.0})
    state.set_registry("undated", {"removed": True})
    assert state.sweep_tombstones(removed_before=2000.0) == 2
    assert sorted(state.registry()) == ["live", "recent"]


async def test_a_removed_engine_leaves_no_metric_series_behind():
    router = make_router()
    engine = router.engines.all()[0].id
    router.metrics.ttft.labels(engine).observe(0.1)
    router.metrics.upstream_errors.labels(engine, "timeout").inc()
    EVENTS_DROPPED.labels(engine, "malformed").inc()
    ENGINE_TASK_FAILURES.labels(engine, "health", "OSError").inc()
    assert f'engine="{engine}"' in router.metrics.render().decode()
    router.fleet.remove(engine)
    assert f'engine="{engine}"' not in router.metrics.render().decode()


async def test_a_role_changed_through_the_admin_api_is_the_role_on_every_replica():
    """An engine re-started with another connector role is told so by PATCH; the other replica takes it from
    the registry entry (before, role and protocol were fixed once the engine was added)."""
    first, second, feed, recorder = make_router(), make_router(), Feed(), Recorder()
    first.fleet.replicate = recorder.set_registry
    follow_mesh(second.fleet, feed)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first.fleet.run)
        nursery.start_soon(second.fleet.run)
        first.fleet.add(EngineConfig(url="http://127.0.0.1:9", id="e1", role="both"))
        feed.on_registry_change("e1", json.loads(recorder.entries["e1"]))
        assert second.engines.get("e1").config.role == "both"
        patched = await call(first, "PATCH", "/admin/engines/e1",
                             json.dumps({"role": "prefill", "kv_protocol": "opaque"}).encode())
        assert patched.status == 200 and (patched.json()["role"], patched.json()["kv_protocol"]) == ("prefill",
                                                                                                     "opaque")
        entry = json.loads(recorder.entries["e1"])
        feed.on_registry_change("e1", entry)
        assert (second.engines.get("e1").config.role, second.engines.get("e1").config.kv_protocol) == (
            "prefill", "opaque")
        scraped = (await call(second, "GET", "/metrics")).body.decode()
        assert 'kvmesh_engine_role{engine="e1",role="prefill"} 1.0' in scraped
        assert 'engine="e1",role="both"' not in scraped
        refused = await call(first, "PATCH", "/admin/engines/e1", json.dumps({"role": "decoder"}).encode())
        assert refused.status == 400 and refused.json()["error"]["param"] == "role"
        # a peer's entry with a role no router knows is counted and leaves the engine as it was
        feed.on_registry_change("e1", {**entry, "role": "decoder"})
        assert feed.malformed["registry"] == 1 and second.engines.get("e1").config.role == "prefill"
        nursery.cancel_scope.cancel()


async def test_a_request_placed_by_one_replica_heats_the_home_book_of_another():
    """Each replica's home book used to hold only the requests its balancer gave it."""
    first, second = make_router(policy="kv_aware"), make_router(policy="kv_aware")
    states = [MeshState(MeshNode(MeshSettings(secret=b"placements-test-secret-0123", name=name, bind="127.0.0.1:0"),
                                 NAMESPACES)) for name in ("a", "b")]
    for router, state in zip((first, second), states, strict=True):
        follow_mesh(router.fleet, state)
    prompt = "You are a careful assistant. " * 40
    body = json.dumps({"model": MODEL, "stream": True, "messages": [{"role": "system", "content": prompt},
                                                                  {"role": "user", "content": "hi"}]}).encode()
    assert (await call(first, "POST", "/v1/chat/completions", body)).status == 200
    assert first.planner.policy.agree_with_peers and second.planner.policy.agree_with_peers
    (key,) = first.planner.policy.homes._prefixes
    assert second.planner.policy.homes.homes(key) == []
    assert states[0].flush_placements() == 1
    SyncProtocol(states[1].node.doc).on_frame(states[0].node.protocol.update_frame(), 0.0)
    assert second.planner.policy.homes.homes(key) == first.planner.policy.homes.homes(key) != []
