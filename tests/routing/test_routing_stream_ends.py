"""A stream of this router's counts in a new answer's batch by the share of that answer it still runs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.routing import CostModel, EngineView, RouteRequest, make_policy
from gateway.routing.stream_ends import StreamEnds, decoding_depth

seconds = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


def test_an_engine_lists_its_streams_until_each_is_released():
    ends = StreamEnds()
    first, second = ends.add("a", 10.0), ends.add("a", 12.0)
    ends.add("b", 11.0)
    assert sorted(ends.remaining("a", 9.0)) == [1.0, 3.0]
    assert sorted(ends.remaining("a", 11.0)) == [0.0, 1.0]  # one past its expected end counts as ending now
    ends.release(first)
    ends.release(first)  # once only: a second release changes nothing
    assert ends.remaining("a", 9.0) == (3.0,)
    ends.release(second)
    assert ends.remaining("a", 9.0) == () and ends.remaining("b", 9.0) == (2.0,)


@given(st.integers(0, 40), st.lists(seconds, max_size=40), st.floats(min_value=0.001, max_value=100.0))
def test_the_batch_beside_a_new_answer_is_between_the_others_and_the_whole_depth(depth, remaining, horizon):
    beside = decoding_depth(depth, remaining, horizon)
    assert max(0, depth - len(remaining)) - 1e-9 <= beside <= depth + 1e-9
    longer = decoding_depth(depth, [r + 1.0 for r in remaining], horizon)
    assert longer >= beside - 1e-9  # streams that run longer never weigh less
    assert decoding_depth(depth, [horizon] * len(remaining), horizon) == float(depth)  # all outlast it: all whole


def test_streams_ending_now_count_nothing_and_those_outlasting_the_answer_count_whole():
    assert decoding_depth(6, [0.0] * 6, 2.0) == 0.0
    assert decoding_depth(6, [5.0] * 6, 2.0) == 6.0
    assert decoding_depth(8, [1.0, 1.0], 2.0) == 7.0  # six streams of others whole, two of ours half
    assert decoding_depth(6, [0.0] * 6, 0.0) == 6.0  # no decode to share


def _taught() -> CostModel:
    """A decode model that has seen each stream in the batch slow every token by a millisecond."""
    costs = CostModel()
    for depth in range(9):
        for _ in range(6):
            for engine in ("a", "b"):
                costs.decode.observe(engine, depth, 200, 200 * (0.003 + 0.001 * depth))
    return costs


def test_a_hot_prefix_stays_on_its_holder_when_the_streams_there_are_about_to_end():
    """Seed 1's suite shape #12 at a turn's edge: the holder's six streams end within 20 ms of the new request, so
    a 223-token answer decodes beside none of them, and the cached prefix wins; six streams that outlast the new
    answer still make it spill."""
    policy = make_policy("kv_aware", costs=_taught())
    request = RouteRequest("m", 1_400, 87, "k", max_tokens=223)

    def fleet(remaining: float) -> list[EngineView]:
        holder = EngineView("a", "u", exact_blocks=85, running=6, in_flight=6, stream_remaining_s=(remaining,) * 6)
        return [holder, EngineView("b", "u")]

    assert policy.choose(request, fleet(0.02)).chosen == "a"
    assert policy.choose(request, fleet(5.0)).chosen == "b"
