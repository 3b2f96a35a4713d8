"""The lease's invariants in a chaos run (at most one actor, no provision doubled, an actor after the holder
died, survivors alive) fail when the fault they guard against happens, and the cluster `kvmesh up` writes
for them is one the router accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from autoscale.offers import Offer
from autoscale.providers.base import ProvisionResult
from autoscale.providers.command import CommandProvider
from chaos import records as rec
from chaos.invariants import FLOOD_REFUSED, autoscaler_checks, classify, evaluate, survivors_alive
from chaos.monitor import autoscaler_view, read_pool
from chaos.records import AutoscalerView, FaultAction, PoolView, ProcessSample, RequestRecord, Sample
from cluster.router_config import (
    FLOOD_TENANT,
    POOL_SCRIPT,
    STEADY_TENANT,
    ClusterKeys,
    standby_autoscaler,
    write_router_config,
)
from gateway.config import load_config

HOLDER = "partition-kill-holder"
ROUTERS = ["router-0", "router-1", "router-2"]
SPARE = Offer("standby", capacity=4, provisioning_s=0)


def view(acting: bool, term: int = 1, me: str = "m") -> AutoscalerView:
    return AutoscalerView(acting, term, me)


def sample(t: float, acting: tuple[str, ...] = (), pool: PoolView | None = None, dead: tuple[str, ...] = ()) -> Sample:
    return Sample(t, processes={r: ProcessSample(10 + i, r not in dead) for i, r in enumerate(ROUTERS)},
                  autoscaler={r: view(r in acting) for r in ROUTERS}, pool=pool)


def holder_actions(isolate_at: float = 3.0, kill_at: float = 9.0, target: str = "router-0") -> list[FaultAction]:
    return [FaultAction(0, HOLDER, rec.ISOLATE, "router", target, isolate_at, isolate_at, pid=10),
            FaultAction(0, HOLDER, rec.KILL, "router", target, kill_at, kill_at + 0.1, pid=10)]


def test_two_routers_acting_in_one_round_fail_the_single_actor_check():
    one = [sample(0, ("router-0",)), sample(1), sample(2, ("router-1",))]
    assert autoscaler_checks(one, [])["at_most_one_autoscaler_actor"]
    two = [*one, sample(3, ("router-1", "router-2"))]
    assert not autoscaler_checks(two, [])["at_most_one_autoscaler_actor"]


async def provisions_through_the_pool(pool: Path, providers: list[CommandProvider], term: int) -> list[str]:
    """Each provider provisions one spare under ``term`` through the real standby pool script."""
    results: list[ProvisionResult] = []
    async with trio.open_nursery() as nursery:
        for provider in providers:
            provider.attach(nursery)
            provider.provision(SPARE, results.append, term)
    assert all(r.engine is not None for r in results), results
    return sorted(r.request_id for r in results)


def pool_provider(pool: Path) -> CommandProvider:
    return CommandProvider([sys.executable, str(POOL_SCRIPT), str(pool), "http://127.0.0.1:1", "http://127.0.0.1:2"])


def test_two_actors_provisioning_under_one_term_fail_the_doubled_provision_check(tmp_path):
    """Two replicas that both act for term 7 (a split brain) each send ``command-7-1``: the pool script records
    two provisions of one request id, and the check reads that from the pool's file."""
    doubled = tmp_path / "doubled.json"
    ids = trio.run(provisions_through_the_pool, doubled, [pool_provider(doubled), pool_provider(doubled)], 7)
    assert ids == ["command-7-1", "command-7-1"]
    seen = read_pool(doubled)
    assert seen is not None and seen.provisions == 2
    assert not autoscaler_checks([sample(1, ("router-0",), seen)], [])["no_provision_doubled"]

    single = tmp_path / "single.json"
    one_actor = pool_provider(single)
    trio.run(provisions_through_the_pool, single, [one_actor], 7)
    trio.run(provisions_through_the_pool, single, [one_actor], 7)
    seen = read_pool(single)
    assert seen == PoolView(2, ("command-7-1", "command-7-2"))
    assert autoscaler_checks([sample(1, ("router-0",), seen)], [])["no_provision_doubled"]


def test_after_the_holder_is_killed_another_router_must_act():
    actions = holder_actions()
    handed_over = [sample(1, ("router-0",)), sample(5), sample(8, ("router-1",)), sample(12, ("router-1",))]
    assert autoscaler_checks(handed_over, actions)["autoscaler_acting_after_the_holder_died"]
    nobody_after = [sample(1, ("router-0",)), sample(8, ("router-1",)), sample(12)]
    assert not autoscaler_checks(nobody_after, actions)["autoscaler_acting_after_the_holder_died"]
    never_killed = actions[:1]
    assert not autoscaler_checks(handed_over, never_killed)["autoscaler_acting_after_the_holder_died"]
    assert "autoscaler_acting_after_the_holder_died" not in autoscaler_checks(handed_over, [])


def test_every_router_no_fault_ended_must_be_alive_at_the_end():
    actions = holder_actions()
    assert survivors_alive([sample(1), sample(12, dead=("router-0",))], ROUTERS, actions)
    assert not survivors_alive([sample(1), sample(12, dead=("router-2",))], ROUTERS, actions)
    assert not survivors_alive([sample(1), sample(12, dead=("router-0",))], ROUTERS, [])
    assert not survivors_alive([], ROUTERS, actions)


def test_only_the_flooding_tenant_may_be_told_to_slow_down():
    refused = RequestRecord(0, 1.0, 1.1, status=429, tenant=FLOOD_TENANT)
    assert classify(refused, [], []) == FLOOD_REFUSED
    steady = RequestRecord(1, 1.0, 1.1, status=429, tenant=STEADY_TENANT)
    assert classify(steady, [], []) == "router_error_429"
    runs = [RequestRecord(i, 1.0, 1.2, status=200) for i in range(3)]
    samples = [sample(t, ("router-1",) if t > 9 else ("router-0",) if t < 3 else ()) for t in range(14)]
    ok = evaluate([*runs, refused], holder_actions(), samples, ROUTERS, [], 14.0, 1.0)
    assert ok.invariants["no_failure_a_live_engine_could_have_served"], ok.invariants
    bad = evaluate([*runs, steady], holder_actions(), samples, ROUTERS, [], 14.0, 1.0)
    assert not bad.invariants["no_failure_a_live_engine_could_have_served"]


@pytest.mark.parametrize("payload", [None, [], {"acting": "yes", "term": 1, "me": "a"},
                                     {"acting": True, "term": True, "me": "a"}, {"acting": True, "term": 1}])
def test_a_malformed_autoscaler_answer_reads_as_no_answer(payload):
    assert autoscaler_view(payload) is None
    assert autoscaler_view({"acting": True, "term": 3, "me": "a", "other": 1}) == view(True, 3, "a")


def test_a_missing_or_malformed_pool_file_reads_as_unknown(tmp_path):
    assert read_pool(tmp_path / "absent.json") is None
    for text in ("{", "[]", '{"provisions": "2"}'):
        (tmp_path / "pool.json").write_text(text)
        assert read_pool(tmp_path / "pool.json") is None


def test_the_router_accepts_the_autoscaler_and_tenants_kvmesh_up_writes(tmp_path):
    keys = ClusterKeys.generate()
    auth, tenants = keys.tables()
    table, offers = standby_autoscaler(3, 2, ["http://127.0.0.1:9001"], tmp_path / "pool.json")
    path = write_router_config(tmp_path / "router.toml", {}, {"auth": auth, "autoscaler": table},
                               {"tenants": tenants, "autoscaler.offers": offers})
    config = load_config(str(path), cli={}, extra_engines=["http://127.0.0.1:9000"])
    assert config.autoscaler.enabled and config.autoscaler.replicas == 3
    assert (config.autoscaler.min_engines, config.autoscaler.max_engines) == (2, 3)
    assert {t.name: t.priority for t in config.tenants} == {STEADY_TENANT: "high", FLOOD_TENANT: "low"}
    assert keys.admin not in path.read_text() and all(k not in path.read_text() for k in keys.tenants.values())
    assert ClusterKeys.load(keys.save(tmp_path / "keys.json")) == keys
    assert (tmp_path / "keys.json").stat().st_mode & 0o077 == 0
