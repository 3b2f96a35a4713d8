"""The decision core: triggers, sizing, release order, offers, cooldowns, bounds, dry-run."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscale.decision import Autoscaler, EngineSignal, FleetSignals, ScalePolicy, release_order
from autoscale.offers import Offer, Placement, choose_offer

OFFER = Offer("a40", island="rack-a", price_per_hour=1.0, capacity=4, provisioning_s=30)


def engines(count: int, waiting: int = 0, running: int = 0, **kw) -> list[EngineSignal]:
    return [EngineSignal(f"e{i}", waiting=waiting, running=running, **kw) for i in range(count)]


def scaler(**kw) -> Autoscaler:
    kw.setdefault("cooldown_s", 60)
    kw.setdefault("step_cooldown_s", 10)
    return Autoscaler(ScalePolicy(**{"down_stable_s": 0.0, **kw}), [OFFER])  # scale down at once unless told


def test_queue_depth_scales_up_by_what_demand_needs():
    # 2 engines, each running 4 (its capacity) with 8 waiting: demand 24, needs 24 / (4 * 0.7) = 9 engines
    decision = scaler(max_engines=20, max_step_up=10).decide(FleetSignals(engines(2, waiting=8, running=4)), 0)
    assert decision.action == "up" and decision.count == 7 and decision.offer == OFFER
    assert "queue depth" in decision.reason and decision.triggers["needed"] == 9


def test_capacity_is_measured_from_saturated_engines():
    auto = scaler(max_engines=50, max_step_up=50)
    for t in range(20):  # engines that run 8 at once while queueing: the nominal 4 was too low
        auto.decide(FleetSignals(engines(2, waiting=1, running=8)), t * 1000)
    assert auto.capacity.value > 7


def test_requests_in_flight_beyond_capacity_are_a_queue_before_the_engine_reports_one():
    # capacity 4, 7 in flight, the polled counts not caught up yet (running 4, waiting 0): 3 are queued
    decision = scaler(queue_up=2.0, target_utilisation=0.99).decide(
        FleetSignals([EngineSignal("e0", running=4, in_flight=7)]), 0)
    assert decision.action == "up" and "queue depth 3.00" in decision.reason


def test_a_request_waiting_for_the_next_step_beside_a_free_slot_is_no_queue():
    decision = scaler(queue_up=0.5, queue_drain=0.2).decide(FleetSignals(engines(1, waiting=1)), 0)
    assert decision.action == "hold" and decision.triggers["avg_queue"] == 0


def test_demand_over_target_utilisation_grows_the_fleet_before_a_queue_forms():
    auto = scaler(target_utilisation=0.7, max_engines=10)
    # 2 engines of capacity 4 running 3 each: demand 6 needs ceil(6 / 2.8) = 3 engines, no queue yet
    decision = auto.decide(FleetSignals(engines(2, running=3)), 0)
    assert decision.action == "up" and decision.count == 1 and "needs 3 engines" in decision.reason
    # the same demand with the third engine still provisioning: nothing more to add
    assert auto.decide(FleetSignals(engines(2, running=3), pending=1), 20).action == "hold"
    # at the target (demand 5 <= 2 * 4 * 0.7) the fleet stays
    at_target = FleetSignals([EngineSignal("e0", running=2), EngineSignal("e1", running=3)])
    assert scaler(target_utilisation=0.7).decide(at_target, 0).action == "hold"


def test_an_engine_running_more_than_the_estimate_raises_it_at_once():
    auto = scaler(max_engines=10)  # nominal capacity 4
    decision = auto.decide(FleetSignals(engines(2, running=6)), 0)
    assert auto.capacity.value == 6 and decision.triggers["avg_queue"] == 0


def test_ttft_ceiling_scales_up_even_without_a_queue():
    decision = scaler(ttft_p99_ceiling_s=1.0).decide(FleetSignals(engines(2, running=1), ttft_p99_s=1.5), 0)
    assert decision.action == "up" and decision.count == 1 and "ttft" in decision.reason


def test_low_hit_ratio_scales_up_only_while_saturated():
    saturated = FleetSignals(engines(2, running=4), hit_ratio=0.05)
    assert scaler().decide(saturated, 0).action == "up"
    calm = FleetSignals(engines(2, running=2), hit_ratio=0.05)
    assert scaler().decide(calm, 0).action == "hold"


def test_scale_down_releases_the_cheapest_loss():
    fleet = [EngineSignal("warm", unique_blocks=500), EngineSignal("busy", in_flight=1),
             EngineSignal("cold"), EngineSignal("static", managed=False)]
    decision = scaler(min_engines=1).decide(FleetSignals(fleet), 0)
    assert decision.action == "down" and decision.release == ("cold",)


def test_equal_cache_cost_releases_the_most_expensive_first():
    fleet = [EngineSignal("cheap", price_per_hour=1.0), EngineSignal("dear", price_per_hour=3.0)]
    assert [e.id for e in release_order(fleet)] == ["dear", "cheap"]


def test_never_below_min_or_above_max():
    assert scaler(min_engines=3).decide(FleetSignals(engines(1)), 0).count == 2
    at_max = scaler(max_engines=2).decide(FleetSignals(engines(2, waiting=50, running=4)), 0)
    assert at_max.action == "hold" and "max_engines" in at_max.reason
    idle = scaler(min_engines=2).decide(FleetSignals(engines(2)), 0)
    assert idle.action == "hold"


def test_pending_provisions_count_toward_the_fleet():
    decision = scaler(max_engines=3).decide(FleetSignals(engines(2, waiting=20, running=4), pending=1), 0)
    assert decision.action == "hold"


def test_opposite_direction_waits_for_the_cooldown():
    auto = scaler(min_engines=1)
    assert auto.decide(FleetSignals(engines(2, waiting=9, running=4)), 0).action == "up"
    assert auto.decide(FleetSignals(engines(4)), 30).action == "hold"
    assert auto.decide(FleetSignals(engines(4)), 60).action == "down"


def test_scale_down_waits_until_idle_for_down_stable_s():
    auto = scaler(min_engines=1, down_stable_s=5)
    assert auto.decide(FleetSignals(engines(3)), 0).action == "hold"
    assert auto.decide(FleetSignals(engines(3)), 4).action == "hold"
    assert auto.decide(FleetSignals(engines(3, running=2)), 4.5).action == "hold"  # busy again, within target
    assert auto.decide(FleetSignals(engines(3)), 6).action == "hold"
    assert auto.decide(FleetSignals(engines(3)), 11).action == "down"


def test_dry_run_marks_decisions():
    decision = scaler(dry_run=True).decide(FleetSignals(engines(1, waiting=9, running=4)), 0)
    assert decision.dry_run and decision.as_json()["dry_run"] is True


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="queue_drain"):
        ScalePolicy(queue_up=1, queue_drain=2).validate()
    with pytest.raises(ValueError, match="offer"):
        Autoscaler(ScalePolicy(), [])


def test_offer_choice_cheapest_within_latency_hot_island_first():
    offers = [Offer("far-cheap", island="rack-c", price_per_hour=0.5, capacity=4),
              Offer("near", island="rack-a", price_per_hour=2.0, capacity=4),
              Offer("hot", island="rack-b", price_per_hour=3.0, capacity=4),
              Offer("slow", island="rack-a", price_per_hour=0.1, capacity=4, provisioning_s=900)]
    placement = Placement(latency_limit_ms=60, cross_island_ms=50, provisioning_limit_s=600)
    assert choose_offer(offers, "rack-a", None, placement).name == "far-cheap"
    assert choose_offer(offers, "rack-a", "rack-b", placement).name == "hot"
    strict = Placement(latency_limit_ms=10, cross_island_ms=50)
    assert choose_offer(offers, "rack-a", "rack-b", strict).name == "near"
    assert choose_offer(offers[:1], "rack-a", None, strict) is None


signal = st.builds(EngineSignal, id=st.sampled_from([f"e{i}" for i in range(8)]),
                   waiting=st.integers(0, 40), running=st.integers(0, 16), in_flight=st.integers(0, 40),
                   unique_blocks=st.integers(0, 1000), draining=st.booleans())
fleet_signals = st.builds(FleetSignals, engines=st.lists(signal, max_size=8, unique_by=lambda e: e.id),
                          pending=st.integers(0, 2), hit_ratio=st.none() | st.floats(0, 1),
                          ttft_p99_s=st.none() | st.floats(0, 10))
FORCED = ("below min_engines", "above max_engines")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 40), fleet_signals), max_size=40), st.integers(0, 3), st.integers(3, 8))
def test_hysteresis_bounds_and_determinism(steps, low, high):
    policy = ScalePolicy(min_engines=low, max_engines=high, cooldown_s=60, step_cooldown_s=10)
    first, second = Autoscaler(policy, [OFFER]), Autoscaler(policy, [OFFER])
    now, changes, last = 0.0, [], None
    for gap, signals in steps:
        now += gap
        decision = first.decide(signals, now)
        assert second.decide(signals, now) == decision  # deterministic
        fleet = sum(1 for e in signals.engines if not e.draining) + signals.pending
        if decision.action == "up":
            assert fleet + decision.count <= high and decision.offer is not None
        if decision.action == "down":
            assert fleet - decision.count >= low or decision.reason == "above max_engines"
            managed = {e.id for e in signals.engines if not e.draining}
            assert set(decision.release) <= managed
        if decision.action != "hold" and decision.reason not in FORCED:
            if last is not None and last != decision.action:
                changes.append(now)
            last = decision.action
        elif decision.action != "hold":
            last = decision.action
    assert all(b - a >= 60 for a, b in zip(changes, changes[1:], strict=False))


busy_engine = st.builds(EngineSignal, id=st.uuids().map(str), waiting=st.integers(0, 6), running=st.integers(0, 4),
                        in_flight=st.integers(0, 12))


@settings(max_examples=200, deadline=None)
@given(st.lists(busy_engine, min_size=1, max_size=8, unique_by=lambda e: e.id), st.floats(0.3, 1.0))
def test_without_other_triggers_the_fleet_grows_exactly_to_what_demand_needs_at_target(fleet, target):
    policy = ScalePolicy(min_engines=0, max_engines=64, max_step_up=64, queue_up=1000, queue_drain=0.0,
                         utilisation_floor=min(0.2, target / 2), target_utilisation=target)
    decision = Autoscaler(policy, [OFFER]).decide(FleetSignals(fleet), 0)
    needed = decision.triggers["needed"]
    assert (decision.action == "up") == (needed > len(fleet))
    if decision.action == "up":  # up to max_engines: eight busy engines at a low target can need more
        assert len(fleet) + decision.count == min(needed, policy.max_engines)
