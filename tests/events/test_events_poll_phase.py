"""A fleet's periodic polls fall at phases spread over the interval, each engine's at its own."""

from __future__ import annotations

import math

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from events.metrics_poller import poll_metrics
from events.poll_phase import next_poll_at, next_tick, phase_s

INTERVAL_S = 1.0
ENGINES = [f"10.0.0.{n}:8000" for n in range(32)]
METRICS = b"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
"""


def test_the_next_tick_is_strictly_after_now_at_a_multiple():
    assert next_tick(0.0, 0.005) == 0.005
    assert math.isclose(next_tick(1.0021, 0.005), 1.005)
    for now in (0.0, 0.0049, 1.005, 3.14159, 1e6 + 0.001, *(k * 0.005 for k in range(1, 400))):
        tick = next_tick(now, 0.005)
        assert now < tick <= now + 0.005 + 1e-9


@settings(max_examples=300, deadline=None)
@given(st.floats(0.0, 1e6), st.sampled_from([0.005, 0.25, 1.0, 15.0]), st.floats(0.0, 0.999))
def test_the_next_poll_is_after_now_within_one_interval_and_at_the_phase(now, interval, share):
    phase = share * interval
    due = next_poll_at(now, interval, phase)
    assert now < due <= now + interval + 1e-6 * max(1.0, now)
    cycles = (due - phase) / interval
    assert abs(cycles - round(cycles)) < 1e-6 * max(1.0, now)


def test_phases_are_the_same_in_every_process_and_apart_with_an_offset():
    """A fixed value: a per-process salted hash (Python's ``hash``) would give each replica its own phases."""
    assert phase_s("a:1", 1.0) == 0.7583564682863653
    assert math.isclose(phase_s("a:1", 2.0), 2 * 0.7583564682863653)
    assert math.isclose((phase_s("a:1", 2.0, 0.5) - phase_s("a:1", 2.0)) % 2.0, 1.0)


async def test_a_fleets_metrics_polls_spread_over_the_interval(autojump_clock):
    """32 engines' pollers started together: after the first round each engine polls at its phase, and no tenth of
    the interval holds more than a quarter of them. Sleeping an interval from each poll (as before) kept the engines'
    polls together, and the phase assertion fails."""
    polls: dict[str, list[float]] = {e: [] for e in ENGINES}

    def fetcher(engine: str):
        async def fetch(url: str) -> bytes:
            polls[engine].append(trio.current_time())
            await trio.sleep(0.001)
            return METRICS
        return fetch

    async with trio.open_nursery() as nursery:
        for engine in ENGINES:
            nursery.start_soon(lambda e=engine: poll_metrics(e, "/metrics", fetcher(e), lambda load, now: None,
                                                              interval_s=INTERVAL_S))
        await trio.sleep(5.5)
        nursery.cancel_scope.cancel()
    for engine, times in polls.items():
        assert len(times) >= 5
        for t in times[1:]:
            assert math.isclose(t % INTERVAL_S, phase_s(engine, INTERVAL_S), abs_tol=1e-6)
    offsets = sorted(times[1] % INTERVAL_S for times in polls.values())
    crowded = max(sum(1 for o in offsets if start <= o < start + INTERVAL_S / 10) for start in offsets)
    assert crowded <= len(ENGINES) // 4
