"""Every policy: live engines first, stable hashing, stickiness, fairness, the registry."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_strategies import fleets, requests

from gateway.routing import POLICY_NAMES, EngineView, RouteRequest, make_policy, prefix_key
from gateway.routing.hashing import fmix64, key_hash, rendezvous_weight
from gateway.routing.kv_aware import cost_order


def _policy(name: str):
    return make_policy(name, rng=random.Random(1))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(POLICY_NAMES), fleets(), requests())
def test_unhealthy_or_draining_engines_are_never_chosen_while_a_live_one_exists(name, fleet, request):
    decision = _policy(name).choose(request, fleet)
    live = {e.id for e in fleet if e.live}
    if live:
        assert set(decision.ranked) == live
    else:
        assert set(decision.ranked) == {e.id for e in fleet}
        assert "no-live-engine" in decision.reason
        healthy_first = [e.id in {f.id for f in fleet if f.healthy} for e in map(_by_id(fleet), decision.ranked)]
        assert healthy_first == sorted(healthy_first, reverse=True)
    assert [row.engine for row in decision.table] == decision.ranked
    assert decision.policy == name


def _by_id(fleet):
    return {e.id: e for e in fleet}.__getitem__


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_engines_gives_an_empty_decision(name):
    decision = _policy(name).choose(RouteRequest("m", 10), [])
    assert decision.ranked == [] and decision.chosen is None and decision.reason == "no-engine"


def test_key_hash_is_pinned_and_fmix_matches_published_vectors():
    """Replicas must agree on every key's hash (blake2b with an 8-byte digest of the UTF-8 key, read
    big-endian): pinned here, since a change moves keys between engines while versions are mixed."""
    assert key_hash("") == 0xE4A6A0577479B2B4
    assert key_hash("abc") == 0xD8BB14D833D59559
    assert fmix64(0) == 0
    assert fmix64(1) == 0xB456BCFC34C2CB2C


@given(st.lists(st.text(max_size=8), min_size=1, max_size=8, unique=True), st.text(), st.randoms())
def test_prefix_hash_ignores_the_order_engines_are_listed_in(ids, key, rnd):
    policy = make_policy("prefix_hash")
    fleet = [EngineView(i, "u") for i in ids]
    shuffled = fleet[:]
    rnd.shuffle(shuffled)
    request = RouteRequest("m", 100, prefix_key=key)
    assert policy.choose(request, fleet).ranked == policy.choose(request, shuffled).ranked


def test_prefix_hash_moves_only_the_keys_of_an_engine_that_leaves():
    policy = make_policy("prefix_hash")
    fleet = [EngineView(f"engine-{i}", "u") for i in range(5)]
    keys = [prefix_key("m", f"system {i % 97}", f"question {i}") for i in range(3000)]
    before = {k: policy.choose(RouteRequest("m", 100, prefix_key=k), fleet).chosen for k in keys}
    shares = Counter(before.values())
    assert all(500 <= n <= 700 for n in shares.values()), shares
    after = {k: policy.choose(RouteRequest("m", 100, prefix_key=k), fleet[1:]).chosen for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "engine-0"}
    assert 0.15 <= len(moved) / len(keys) <= 0.25


def test_prefix_key_keeps_only_the_first_256_characters():
    assert prefix_key("m", "s" * 300, "u" * 300) == prefix_key("m", "s" * 256 + "x", "u" * 256 + "y")
    assert prefix_key("m", "a", "b") != prefix_key("n", "a", "b")
    assert prefix_key("m", "ab", "") != prefix_key("m", "a", "b")


@given(st.text(min_size=1), st.randoms())
def test_a_session_sticks_to_one_engine_whatever_the_load(session, rnd):
    policy = make_policy("session")
    request = RouteRequest("m", 100, prefix_key="p", session_key=session)
    homes = set()
    for _ in range(5):
        fleet = [EngineView(f"e{i}", "u", in_flight=rnd.randint(0, 50)) for i in range(4)]
        rnd.shuffle(fleet)
        homes.add(policy.choose(request, fleet).chosen)
    assert len(homes) == 1


def test_a_session_moves_only_while_its_engine_is_down():
    policy = make_policy("session")
    request = RouteRequest("m", 100, session_key="alice")
    fleet = [EngineView(f"e{i}", "u") for i in range(4)]
    home, runner_up = policy.choose(request, fleet).ranked[:2]
    down = [EngineView(e.id, "u", healthy=e.id != home) for e in fleet]
    assert policy.choose(request, down).chosen == runner_up
    assert policy.choose(request, fleet).chosen == home


def test_without_a_session_key_session_routes_to_the_least_loaded():
    fleet = [EngineView("a", "u", in_flight=3), EngineView("b", "u", in_flight=1), EngineView("c", "u", in_flight=2)]
    decision = make_policy("session").choose(RouteRequest("m", 100), fleet)
    assert decision.ranked == ["b", "c", "a"]
    assert decision.reason == "least-loaded (no session)"


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7), st.integers(1, 20), st.randoms())
def test_round_robin_is_fair_whatever_the_listing_order(n, rounds, rnd):
    policy = make_policy("round_robin")
    fleet = [EngineView(f"e{i}", "u", in_flight=i) for i in range(n)]
    counts: Counter[str] = Counter()
    for _ in range(n * rounds):
        rnd.shuffle(fleet)
        counts[policy.choose(RouteRequest("m", 10), fleet).chosen] += 1
    assert counts == Counter({e.id: rounds for e in fleet})


def test_least_loaded_prefers_router_in_flight_then_engine_queue():
    fleet = [
        EngineView("a", "u", in_flight=2, running=0),
        EngineView("b", "u", in_flight=1, running=9, waiting=3),
        EngineView("c", "u", in_flight=1, running=2),
    ]
    assert make_policy("least_loaded").choose(RouteRequest("m", 10), fleet).ranked == ["c", "b", "a"]


def test_random_is_reproducible_with_an_injected_generator_and_covers_every_engine():
    fleet = [EngineView(f"e{i}", "u") for i in range(4)]
    first = make_policy("random", rng=random.Random(5))
    second = make_policy("random", rng=random.Random(5))
    picks = [first.choose(RouteRequest("m", 10), fleet).chosen for _ in range(200)]
    assert picks == [second.choose(RouteRequest("m", 10), fleet[::-1]).chosen for _ in range(200)]
    assert set(picks) == {e.id for e in fleet}


def test_duplicate_engine_views_count_once():
    fleet = [EngineView("a", "u", in_flight=9), EngineView("a", "u"), EngineView("b", "u", in_flight=1)]
    decision = make_policy("least_loaded").choose(RouteRequest("m", 10), fleet)
    assert decision.ranked == ["b", "a"]


def test_unknown_policy_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="kv_aware"):
        make_policy("fastest")


def test_feedback_teaches_every_policy_through_the_shared_cost_model():
    policy = make_policy("round_robin")
    assert policy.observe("a", 1000, 0, 0.5)
    assert not policy.observe("a", -1, 0, 0.5)
    assert policy.costs.learner.rejected == 1
    assert policy.costs.learner.model("a").observations == 1


@settings(max_examples=80, deadline=None)
@given(fleets(max_size=8), requests(), st.integers(0, 3))
def test_cost_order_is_the_full_sort_with_rendezvous_ties_worked_out_only_where_needed(fleet, request, clones):
    """``cost_order`` hashes engines only inside groups tied on cost, queue and in-flight count; the order must be the
    one sorting every engine by all four keys gives (clones of the first engine make such ties)."""
    pool = list({e.id: e for e in fleet}.values())
    pool += [msgspec.structs.replace(pool[0], id=f"clone{n}") for n in range(clones)]
    policy = make_policy("kv_aware")
    scores = policy.costs.estimate_all(request, pool, policy.knowledge)
    h = key_hash(request.prefix_key or request.model)
    expected = [e.id for e in sorted(pool, key=lambda e: (round(scores[e.id].cost_s, 9), scores[e.id].queue_depth,
                                                          max(0, e.in_flight), -rendezvous_weight(h, e.id)))]
    assert cost_order(request, pool, scores) == expected
