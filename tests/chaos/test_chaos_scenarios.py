"""Fault schedules: feasible on the cluster, non-overlapping, healed inside the run, targets rotated."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chaos.scenarios import (
    FAULT_ROLES,
    HOLDER_FAULTS,
    INSTANT_HEAL,
    MIXED_ORDER,
    SCENARIOS,
    Topology,
    feasible,
    schedule,
    warmup_for,
)

FULL = Topology(routers=3, engines=3, redis=True)


@given(st.sampled_from(SCENARIOS), st.floats(60, 600), st.integers(2, 5), st.integers(2, 5), st.booleans(),
       st.booleans())
def test_schedules_never_overlap_and_start_after_warmup(name, duration, routers, engines, redis, autoscaler):
    topology = Topology(routers, engines, redis, autoscaler)
    if name in FAULT_ROLES and feasible(name, topology):
        with pytest.raises(ValueError):
            schedule(name, duration, topology)
        return
    events = schedule(name, duration, topology)
    assert events and events[0].inject_at >= warmup_for(duration)
    for a, b in zip(events, events[1:], strict=False):
        assert a.heal_at < b.inject_at
    for e in events:
        assert e.role == FAULT_ROLES[e.kind]
        assert e.heal_at >= e.inject_at and (e.heal_at == e.inject_at) == (e.kind in INSTANT_HEAL)
        assert e.heal_at <= duration
        assert 0 <= e.target < {"router": routers, "engine": engines, "redis": 1}[e.role]


def test_mixed_runs_every_kind_once_in_a_minute_and_rotates_targets():
    events = schedule("mixed", 60, FULL)
    assert sorted(e.kind for e in events) == sorted(MIXED_ORDER)
    routers = [e.target for e in events if e.role == "router"]
    assert routers == [0, 1, 2]


def test_the_streaming_scenario_repeats_engine_kills():
    events = schedule("kill-engine-streaming", 60, FULL)
    assert events and {(e.kind, e.role) for e in events} == {("kill-engine", "engine")}
    with pytest.raises(ValueError, match="at least 2 engines"):
        schedule("kill-engine-streaming", 60, Topology(3, 1, True))


def test_mixed_without_redis_skips_kill_redis_and_single_fault_repeats():
    assert "kill-redis" not in {e.kind for e in schedule("mixed", 60, Topology(3, 3, False))}
    repeated = schedule("kill-engine", 120, FULL)
    assert len(repeated) > 1 and [e.target for e in repeated[:3]] == [0, 1, 2]


@pytest.mark.parametrize(("name", "topology"), [("kill-router", Topology(1, 3, True)),
                                                ("pause-engine", Topology(3, 1, True)),
                                                ("nonsense", FULL)])
def test_infeasible_or_unknown_scenarios_are_refused(name, topology):
    with pytest.raises(ValueError):
        schedule(name, 60, topology)


def test_mixed_refuses_a_run_too_short_for_its_faults():
    with pytest.raises(ValueError, match="mixed needs"):
        schedule("mixed", 20, FULL)


def test_the_holder_fault_runs_once_on_three_routers_with_an_autoscaler():
    autoscaled = Topology(3, 2, False, autoscaler=True)
    (event,) = schedule("partition-kill-holder", 120, autoscaled, fault_s=90)
    assert event.kind in HOLDER_FAULTS and (event.inject_at, event.heal_at) == (10, 100)
    with pytest.raises(ValueError, match="3 routers with an autoscaler"):
        schedule("partition-kill-holder", 120, Topology(3, 2, False))
    with pytest.raises(ValueError, match="3 routers"):
        schedule("partition-kill-holder", 120, Topology(2, 2, False, autoscaler=True))
    with pytest.raises(ValueError, match="at least 96 s"):
        schedule("partition-kill-holder", 60, autoscaled, fault_s=90)
