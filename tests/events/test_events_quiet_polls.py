"""A quiet engine's /metrics is polled every few ticks; any sign of requests brings the poll back to every tick."""

from __future__ import annotations

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from events.metrics_poller import poll_metrics
from events.quiet_polls import QUIET_MAX_S, QUIET_TICKS, QuietPolls, quiet_ticks
from index.freshness import FreshnessPolicy

IDLE = b"""\
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0
"""
BUSY = IDLE.replace(b"running{engine=\"0\",model_name=\"tiny\"} 0.0", b"running{engine=\"0\",model_name=\"tiny\"} 2.0")


def test_a_quiet_engines_gap_stays_fresh_for_the_freshness_policy():
    assert FreshnessPolicy().poll_stale_s > QUIET_MAX_S
    assert quiet_ticks(1.0) == QUIET_TICKS
    assert quiet_ticks(0.2) == QUIET_TICKS
    assert quiet_ticks(2.0) == 2
    assert quiet_ticks(3.0) == 1
    assert quiet_ticks(60.0) == 1
    assert quiet_ticks(0.0) == 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.booleans(), st.integers(0, 2), st.sampled_from([None, True, False])),
                                   max_size=60))
def test_no_quiet_run_is_longer_than_quiet_every_and_activity_always_polls(every, ticks):
    """Whatever the ticks bring, a tick with activity, an event mark that moved, or after a busy or failed poll
    polls; of the rest at most ``every - 1`` in a row are skipped."""
    cadence = QuietPolls(every)
    mark, busy_before, skipped = 0, True, 0
    for active, step, answer in ticks:
        moved = step > 0
        mark += step
        polled = cadence.due(active, mark)
        if active or moved or busy_before:
            assert polled
        if polled:
            skipped = 0
            busy_before = answer is not False  # a failed poll (None) is taken again at the next tick
            if answer is not None:
                cadence.polled(answer)
        else:
            skipped += 1
            assert skipped <= every - 1


async def test_a_quiet_engine_is_polled_every_fourth_tick_until_its_events_move(autojump_clock):
    """An idle engine is polled once in four ticks; a tick after its events moved polls, and while its polls show
    requests running every tick polls."""
    polls: list[float] = []
    pages = {"now": IDLE}
    cadence = QuietPolls(quiet_ticks(1.0))
    mark = {"events": 0}

    async def fetch(url: str) -> bytes:
        polls.append(trio.current_time())
        return pages["now"]

    def on_load(load, now) -> None:
        cadence.polled(load.running + load.waiting > 0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: poll_metrics("e", "/metrics", fetch, on_load, interval_s=1.0,
                                                due=lambda: cadence.due(False, mark["events"])))
        await trio.sleep(20.5)
        idle_polls = len(polls)
        assert 5 <= idle_polls <= 7, polls  # 20 ticks, a poll every fourth (the first tick's poll included)
        mark["events"] += 1  # another client's prefill stored blocks
        pages["now"] = BUSY
        await trio.sleep(1.0)
        assert len(polls) == idle_polls + 1
        await trio.sleep(5.0)
        assert len(polls) == idle_polls + 6  # running requests: every tick
        pages["now"] = IDLE
        await trio.sleep(12.0)
        assert len(polls) <= idle_polls + 6 + 1 + 3  # one poll sees it idle, then every fourth tick
        nursery.cancel_scope.cancel()
