"""The cost model against a brute-force reference, and the behaviours that fall out of it."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_strategies import fleets, requests

from gateway.routing import CostModel, CostSettings, EngineView, RouteRequest, make_policy, queue_depth
from gateway.routing.cost import Knowledge
from gateway.routing.hashing import rendezvous_order
from gateway.routing.learning import TTFTParams


def reference_ttft(engine: EngineView, request: RouteRequest, p: TTFTParams, s: CostSettings) -> float:
    """Walk the request's life step by step with the same parameters: requests ahead, token by token."""
    t = p.overhead_s
    slots = engine.max_num_seqs or math.inf
    occupied = 0
    for _ in range(max(engine.in_flight, engine.running - engine.finished_since_poll) + engine.waiting):
        if occupied < slots:
            occupied += 1
            t += p.batch_s_per_request
        else:
            t += p.slot_wait_s_per_request
    if occupied >= slots:
        t += p.slot_wait_s_per_request
    exact = engine.exact_blocks * engine.block_size
    approx = engine.approx_blocks * engine.block_size
    computed = 0.0
    for i in range(request.prompt_tokens):
        credit = 1.0 if i < exact else s.approx_trust if i < approx else 0.0
        computed += 1.0 - engine.confidence * credit
    computed = math.ceil(computed - 1e-9)
    t += p.prefill_s_per_token * computed
    if engine.num_blocks:
        free = engine.num_blocks * engine.block_size * (1.0 - engine.kv_usage)
        capacity = engine.num_blocks * engine.block_size
        recomputed = 0
        for k in range(computed + (request.max_tokens or 0)):
            if k + 1 > free and recomputed < capacity:
                recomputed += 1
        t += p.prefill_s_per_token * recomputed
    if request.router_island is not None and engine.island not in (None, request.router_island):
        t += s.cross_island_s
    return t


def reference_decode(engine: EngineView, request: RouteRequest, costs: CostModel) -> float:
    """Token by token after the first, each at the engine's time per token for the batch it joins."""
    depth = max(engine.in_flight, engine.running - engine.finished_since_poll) + engine.waiting
    tokens = costs.decode.expected_output_tokens(request.max_tokens)
    per_token = costs.decode.time_per_token_s(engine.id, depth)
    t, produced = 0.0, 1.0
    while produced < tokens:
        t += per_token * min(1.0, tokens - produced)
        produced += 1.0
    return t


def trained_costs(seed: int) -> CostModel:
    """A cost model whose engines have learned different speeds, so candidates differ in parameters too."""
    costs = CostModel()
    rng = random.Random(seed)
    for i in range(6):
        speed = rng.uniform(0.5, 3.0)
        for _ in range(rng.randint(0, 30)):
            uncached, depth = rng.randint(0, 4000), rng.randint(0, 30)
            costs.learner.observe(f"e{i}", uncached, depth, 0.01 + speed * (4e-5 * uncached + 0.003 * depth))
            costs.decode.observe(f"e{i}", depth, rng.randint(2, 200), rng.randint(2, 200) * speed * 0.001 * (1 + depth))
    return costs


@settings(max_examples=100, deadline=None)
@given(fleets(), requests(), st.integers(0, 1000))
def test_kv_aware_picks_the_engine_the_reference_says_is_fastest(fleet, request, seed):
    costs = trained_costs(seed)
    costs.prepare(fleet)  # every engine has its model before the decision: the reference below fits nothing anew
    decision = make_policy("kv_aware", costs=costs).choose(request, fleet)
    pool = [e for e in fleet if e.live] or [e for e in fleet if e.healthy] or fleet
    reference = {
        e.id: reference_ttft(e, request, costs.learner.params(e.id, e.max_num_seqs), costs.settings) for e in fleet
    }
    done = {e.id: reference[e.id] + reference_decode(e, request, costs) for e in fleet}
    one_token = max(costs.learner.params(e.id, e.max_num_seqs).prefill_s_per_token for e in fleet)
    tolerance = 3 * one_token + 1e-9
    chosen = next(row for row in decision.table if row.engine == decision.chosen)
    allowed = tolerance
    if 2 * chosen.overlap_tokens > chosen.cached_tokens + chosen.uncached_tokens and \
            chosen.cached_tokens >= max(row.cached_tokens for row in decision.table if row.engine in done):
        # ``held_order``: the holder of most of the prompt keeps it unless another engine is faster by more than
        # one deviation of the holder's learned TTFT (its queue and prefill) plus the doubted share of the decode
        # the faster engine would save (at most what the decode-fastest row saves).
        allowed += costs.learner.deviation(chosen.engine) * (chosen.queue_s + chosen.prefill_s)
        allowed += costs.decode.slope_doubt() * max(0.0, chosen.decode_s - min(row.decode_s for row in decision.table))
    assert done[decision.chosen] <= min(done[e.id] for e in pool) + allowed + 1e-6
    for row in decision.table:
        assert math.isclose(row.ttft_s, reference[row.engine], rel_tol=1e-6, abs_tol=tolerance)
        assert math.isclose(row.done_s, done[row.engine], rel_tol=1e-6, abs_tol=tolerance + 1e-6)


def test_more_in_flight_or_waiting_never_looks_faster():
    costs = CostModel()
    request = RouteRequest("m", 1024, 64, "k")
    base = EngineView("a", "u", max_num_seqs=8)
    estimates = [
        costs.estimate(request, EngineView("a", "u", max_num_seqs=8, in_flight=n, waiting=w), Knowledge.EVENTS).ttft_s
        for n in range(0, 20)
        for w in (0, 3)
    ]
    assert costs.estimate(request, base, Knowledge.EVENTS).ttft_s == min(estimates)
    by_in_flight = [
        costs.estimate(request, EngineView("a", "u", max_num_seqs=8, in_flight=n), Knowledge.EVENTS).ttft_s
        for n in range(20)
    ]
    assert all(later > earlier for earlier, later in zip(by_in_flight, by_in_flight[1:], strict=False))


def _dispatch(engine: EngineView, prefix_blocks: int) -> EngineView:
    """What the router's edge does after sending a request: one more in flight, a speculative entry."""
    return EngineView(
        engine.id,
        engine.url,
        in_flight=engine.in_flight + 1,
        exact_blocks=engine.exact_blocks,
        approx_blocks=max(engine.approx_blocks, prefix_blocks),
        max_num_seqs=engine.max_num_seqs,
    )


@given(st.integers(64, 8192), st.integers(2, 5))
def test_a_hot_prefix_spills_once_its_holder_queue_outweighs_the_cache(prefix_tokens, engines):
    policy = make_policy("kv_aware")
    blocks = prefix_tokens // 16
    request = RouteRequest("m", prefix_tokens + 40, blocks, "hot")
    fleet = {f"e{i}": EngineView(f"e{i}", "u", max_num_seqs=256) for i in range(engines)}
    fleet["e0"] = EngineView("e0", "u", exact_blocks=blocks, max_num_seqs=256)
    p = policy.costs.learner.params("e0", 256)
    spill_depth = math.ceil(p.prefill_s(blocks * 16) / p.batch_s_per_request) + 1
    chosen = []
    for _ in range(spill_depth * engines + 4 * engines):
        decision = policy.choose(request, list(fleet.values()))
        chosen.append(decision.chosen)
        fleet[decision.chosen] = _dispatch(fleet[decision.chosen], blocks)
    assert chosen[0] == "e0"
    first_spill = next(i for i, e in enumerate(chosen) if e != "e0")
    assert first_spill <= spill_depth
    assert policy.choose(request, list(fleet.values())).reason.startswith(("cache-hit", "hot-prefix-spill"))
    loads = [e.in_flight for e in fleet.values()]
    assert max(loads) - min(loads) <= spill_depth + 1


def test_spill_is_explained_as_such():
    policy = make_policy("kv_aware")
    request = RouteRequest("m", 2048, 128, "hot")
    fleet = [EngineView("a", "u", exact_blocks=128, in_flight=200), EngineView("b", "u")]
    decision = policy.choose(request, fleet)
    assert decision.chosen == "b"
    assert decision.reason == "hot-prefix-spill"


def test_cache_wins_at_low_load():
    policy = make_policy("kv_aware")
    request = RouteRequest("m", 2048, 128, "k")
    fleet = [EngineView("a", "u", in_flight=1), EngineView("b", "u", exact_blocks=120, in_flight=1)]
    decision = policy.choose(request, fleet)
    assert decision.ranked == ["b", "a"]
    assert decision.reason == "cache-hit 94%"


def test_zero_confidence_routes_by_load_alone():
    policy = make_policy("kv_aware")
    request = RouteRequest("m", 2048, 128, "k")
    fleet = [EngineView("a", "u", exact_blocks=128, confidence=0.0, in_flight=2), EngineView("b", "u")]
    decision = policy.choose(request, fleet)
    assert decision.chosen == "b"
    assert decision.reason == "least-loaded"


def test_ties_go_to_the_least_loaded_then_to_the_prefix_home():
    policy = make_policy("kv_aware")
    request = RouteRequest("m", 100, 6, "k")
    same_estimate = [EngineView("a", "u", running=3, in_flight=1), EngineView("b", "u", running=3, in_flight=0)]
    decision = policy.choose(request, same_estimate)
    assert decision.table[0].ttft_s == decision.table[1].ttft_s
    assert decision.ranked == ["b", "a"]
    idle = [EngineView(f"e{i}", "u") for i in range(5)]
    home = rendezvous_order("k", [e.id for e in idle])
    assert policy.choose(request, idle).ranked == home
    assert policy.choose(request, idle[::-1]).ranked == home


def test_a_full_cache_pushes_work_elsewhere():
    policy = make_policy("kv_aware")
    request = RouteRequest("m", 2048, 128, "k", max_tokens=256)
    fleet = [
        EngineView("a", "u", exact_blocks=64, kv_usage=0.99, num_blocks=200),
        EngineView("b", "u", kv_usage=0.1, num_blocks=200),
    ]
    decision = policy.choose(request, fleet)
    assert decision.chosen == "b"
    assert decision.reason == "kv-pressure"
    assert decision.table[1].pressure_penalty_s > 0


def test_the_router_prefers_its_own_island_all_else_equal():
    policy = make_policy("kv_aware")
    request = RouteRequest("m", 512, 32, "k", router_island="west")
    fleet = [EngineView("a", "u", island="east"), EngineView("b", "u", island="west")]
    assert policy.choose(request, fleet).ranked == ["b", "a"]
    cached_far = [EngineView("a", "u", island="east", exact_blocks=32), EngineView("b", "u", island="west")]
    assert policy.choose(request, cached_far).chosen == "a"


def test_approximate_ignores_event_knowledge():
    request = RouteRequest("m", 2048, 128, "k")
    fleet = [EngineView("a", "u", exact_blocks=128, in_flight=1), EngineView("b", "u", approx_blocks=128, in_flight=1)]
    assert make_policy("approximate").choose(request, fleet).chosen == "b"
    assert make_policy("kv_aware").choose(request, fleet).chosen == "a"


def test_a_turn_stays_with_its_cache_when_the_poll_still_counts_its_finished_previous_turn():
    """The holder's last poll shows two running: this router's previous turn of the chat (finished since)
    and one more. Counting the finished turn as ahead would spill the chat; it is not ahead of anyone."""
    policy = make_policy("kv_aware")
    request = RouteRequest("m", 240, 15, "chat")
    holder = EngineView("holder", "u", running=2, exact_blocks=10)
    other = EngineView("other", "u", running=0)
    stale = policy.choose(request, [holder, other])
    assert stale.table[[s.engine for s in stale.table].index("holder")].queue_depth == 2
    corrected = EngineView("holder", "u", running=2, finished_since_poll=1, exact_blocks=10)
    decision = policy.choose(request, [corrected, other])
    assert decision.table[[s.engine for s in decision.table].index("holder")].queue_depth == 1
    assert queue_depth(corrected) == 1 and queue_depth(EngineView("x", "u", running=1, finished_since_poll=5)) == 0


def test_other_replicas_in_flight_requests_count_before_the_next_poll():
    """Two engines looked idle at the last poll; another replica has since sent four requests to one."""
    policy = make_policy("kv_aware")
    request = RouteRequest("m", 500, 31, "b", max_tokens=64)
    idle = EngineView("idle", "u")
    assert policy.choose(request, [EngineView("busy", "u"), idle]).chosen == "busy"  # the tie-break's pick
    busy = EngineView("busy", "u", peer_in_flight=4)
    decision = policy.choose(request, [busy, idle])
    assert decision.chosen == "idle"
    assert queue_depth(busy) == 4 and queue_depth(EngineView("x", "u", in_flight=2, peer_in_flight=3)) == 5
    assert queue_depth(EngineView("x", "u", peer_in_flight=1, running=6)) == 6


def test_eviction_is_charged_only_once_the_cache_is_full():
    costs = CostModel()
    answer = 16.0  # the tokens the request is expected to answer
    params = costs.learner.params("e", None)
    roomy = EngineView("e", "u", num_blocks=1000, held_blocks=100, reuse_ratio=0.6)
    assert costs.eviction_s(roomy, answer, 1024, params, Knowledge.EVENTS) == 0.0
    full = EngineView("e", "u", num_blocks=1000, held_blocks=1000, reuse_ratio=0.6)
    expected = 0.6 * params.prefill_s(65 * 16)  # 1024 + 16 tokens need 65 blocks
    assert costs.eviction_s(full, answer, 1024, params, Knowledge.EVENTS) == pytest.approx(expected)
    unread = EngineView("e", "u", num_blocks=1000, held_blocks=1000, reuse_ratio=0.0)
    assert costs.eviction_s(unread, answer, 1024, params, Knowledge.EVENTS) == 0.0
    assert costs.eviction_s(EngineView("e", "u", held_blocks=1000, reuse_ratio=0.6), answer, 1024, params,
                            Knowledge.EVENTS) == 0.0  # capacity unknown
    router_only = EngineView("e", "u", num_blocks=1000, held_blocks=1000, approx_held_blocks=0, reuse_ratio=0.6)
    assert costs.eviction_s(router_only, answer, 1024, params, Knowledge.ROUTER_ONLY) == 0.0


def test_a_full_fleet_keeps_a_prefix_on_its_busier_holder_when_its_cache_is_read():
    """Spilling a 1k-token document to an idler engine would evict another document there; how often
    evicted blocks are read again decides whether the spill is worth it. A saturated holder still spills."""
    request = RouteRequest("m", 1040, 65, "doc", max_tokens=16)

    def fleet(reuse: float, ahead: int) -> list[EngineView]:
        common = {"num_blocks": 256, "held_blocks": 256, "reuse_ratio": reuse, "max_num_seqs": 64}
        return [EngineView("holder", "u", exact_blocks=64, in_flight=ahead, **common),
                EngineView("idle", "u", in_flight=0, **common)]

    assert make_policy("kv_aware").choose(request, fleet(0.0, 6)).chosen == "idle"
    assert make_policy("kv_aware").choose(request, fleet(0.9, 12)).chosen == "idle"
    decision = make_policy("kv_aware").choose(request, fleet(0.9, 6))
    assert decision.chosen == "holder"
    idle = next(s for s in decision.table if s.engine == "idle")
    assert idle.eviction_s > 0 and idle.cost_s == pytest.approx(idle.done_s + idle.eviction_s)


def test_a_prefill_stalls_only_the_streams_in_the_batch():
    """Requests waiting for a slot are not decoding yet: the stall counts at most max_num_seqs streams."""
    params = CostModel().learner.params("e", None)
    assert CostModel.stall_s(0, 8, 1000, params) == 0.0
    assert CostModel.stall_s(3, 8, 1000, params) == pytest.approx(3 * params.prefill_s(1000))
    assert CostModel.stall_s(20, 8, 1000, params) == pytest.approx(8 * params.prefill_s(1000))
    assert CostModel.stall_s(20, None, 40, params) == pytest.approx(20 * params.prefill_s(40))


def test_the_blind_eviction_is_worked_out_only_for_policies_that_use_it():
    """kv_aware prices what a request with a home key evicts by its home book, so the cost model leaves the blind term
    at 0 for it; the approximate policy (no homes) and kv_aware's home-less requests still pay it on a full engine."""
    full = EngineView("e", "u", num_blocks=1000, held_blocks=1000, reuse_ratio=0.6)
    homed = RouteRequest("m", 1024, 64, "doc", max_tokens=16, home_key="k")
    costs = CostModel()
    assert costs.estimate_all(homed, [full], Knowledge.EVENTS, blind_eviction=False)["e"].eviction_s == 0.0
    assert costs.estimate_all(homed, [full], Knowledge.EVENTS)["e"].eviction_s > 0.0
    kv_aware, approximate = make_policy("kv_aware"), make_policy("approximate")
    assert kv_aware.prices_evictions(homed) and not approximate.prices_evictions(homed)
    assert not kv_aware.prices_evictions(RouteRequest("m", 1024, 64, "doc", max_tokens=16))
    sent_full = EngineView("e", "u", num_blocks=1000, approx_held_blocks=1000, reuse_ratio=0.6)
    assert approximate.choose(homed, [sent_full]).table[0].eviction_s > 0.0
    assert kv_aware.choose(homed, [full]).table[0].eviction_s == 0.0
    assert make_policy("round_robin").prices_evictions(homed) is False


def test_streams_running_on_a_full_engine_push_a_long_answer_to_an_idle_one():
    """The holder's requests in flight already hold its blocks (``busy_blocks``): a long answer that does not fit
    beside them waits for one of them to finish, so it goes where a prefill is cheaper; one that fits stays."""
    costs = CostModel()
    for _ in range(50):
        costs.decode.observe("a", 5, 480, 480 * 0.004)
    policy = make_policy("kv_aware", costs=costs)
    request = RouteRequest("m", 4_400, 275, "k", max_tokens=480)
    holder = {"exact_blocks": 250, "num_blocks": 830, "running": 5, "in_flight": 5, "busy_shared_blocks": 178}
    full = [EngineView("a", "u", busy_blocks=880, **holder), EngineView("b", "u", num_blocks=830)]
    decision = policy.choose(request, full)
    assert decision.chosen == "b"
    assert decision.table[1].pressure_penalty_s > 0.5
    room = [EngineView("a", "u", busy_blocks=500, **holder), EngineView("b", "u", num_blocks=830)]
    assert policy.choose(request, room).chosen == "a"
