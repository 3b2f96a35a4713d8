"""The cost model survives any number an engine (or a request) may still carry past the pollers' bounds:
no OverflowError, and every candidate gets a finite cost, so one lying engine cannot fail every decision."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.cost import CostModel, Knowledge
from gateway.routing.types import EngineView, RouteRequest

ANY_INT = st.integers(min_value=-(10**320), max_value=10**320) | st.sampled_from([0, 1, 2**31, 10**308, 10**309])
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def engines(draw) -> EngineView:
    return EngineView(
        id="e", url="http://e", in_flight=draw(ANY_INT), peer_in_flight=draw(ANY_INT), running=draw(ANY_INT),
        finished_since_poll=draw(ANY_INT), waiting=draw(ANY_INT), kv_usage=draw(ANY_FLOAT),
        num_blocks=draw(st.none() | ANY_INT), block_size=draw(ANY_INT), exact_blocks=draw(ANY_INT),
        approx_blocks=draw(ANY_INT), confidence=draw(ANY_FLOAT), held_blocks=draw(st.none() | ANY_INT),
        approx_held_blocks=draw(st.none() | ANY_INT), reuse_ratio=draw(ANY_FLOAT),
        max_num_seqs=draw(st.none() | ANY_INT))


def test_a_claimed_1e308_blocks_costs_a_finite_penalty():
    engine = EngineView(id="e", url="http://e", num_blocks=int(float("1e308")), block_size=16, kv_usage=0.5,
                        held_blocks=10)
    score = CostModel().estimate(RouteRequest("m", prompt_tokens=2048, max_tokens=64), engine, Knowledge.EVENTS)
    assert math.isfinite(score.cost_s) and score.pressure_penalty_s == 0.0


@settings(max_examples=400)
@given(engines(), ANY_INT, st.none() | ANY_INT, st.sampled_from(list(Knowledge)))
def test_any_engine_numbers_give_a_finite_cost(engine, prompt_tokens, max_tokens, knowledge):
    score = CostModel().estimate(RouteRequest("m", prompt_tokens=prompt_tokens, max_tokens=max_tokens), engine,
                                 knowledge)
    for value in (score.queue_s, score.prefill_s, score.pressure_penalty_s, score.eviction_s, score.decode_s,
                  score.cost_s):
        assert math.isfinite(value) and value >= 0, score
