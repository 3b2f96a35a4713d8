"""The event-loop share of KV-event ingest: bounded on average and per burst, never starved for good."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.ingest_budget import IngestBudget


def test_a_fresh_budget_allows_one_burst_then_defers_until_refilled():
    budget = IngestBudget(share=0.5, burst_s=0.02)
    assert budget.wait_s(0.0) == 0.0
    budget.charge(0.0, 0.03)  # a slice overran the burst
    wait = budget.wait_s(0.0)
    assert wait == pytest.approx(0.02, abs=1e-3)  # 0.01 s of debt at half a second per second
    assert budget.deferrals == 1
    assert budget.wait_s(wait) == 0.0


@given(st.lists(st.tuples(st.floats(0, 0.01), st.floats(0, 0.05)), min_size=1, max_size=200))
def test_work_admitted_never_exceeds_share_of_elapsed_time_plus_one_burst_and_slice(steps):
    """Whatever the pattern of gaps and slice lengths, ingest that waits when told uses at most
    share * elapsed + burst + its last overrun."""
    budget = IngestBudget(share=0.5, burst_s=0.02, slice_s=0.002)
    now, worked, longest = 0.0, 0.0, 0.0
    for gap, work in steps:
        now += gap
        now += budget.wait_s(now)
        budget.charge(now, work)
        now += work
        worked += work
        longest = max(longest, work)
    assert worked <= 0.5 * now + 0.02 + longest + 1e-9


def test_settings_are_checked():
    for bad in ({"share": 0}, {"share": 1.5}, {"idle_share": 0}, {"burst_s": 0}, {"slice_s": -1}):
        with pytest.raises(ValueError):
            IngestBudget(**bad)


def test_ingest_takes_what_serving_leaves_of_the_loop_less_a_reserve():
    budget = IngestBudget(share=0.3, idle_share=0.9, reserve=0.1, smooth_s=0.5)
    assert budget.rate(0.0) == 0.3  # nobody watches the loop: the low share
    budget.observe_loop(0.0, idle_total_s=0.0)
    budget.charge(0.5, 0.2)
    budget.observe_loop(1.0, idle_total_s=0.5)  # of the second: 0.5 idle, 0.2 ingest, so 0.3 serving
    assert budget.rate(1.0) == pytest.approx(0.6)
    budget.observe_loop(2.0, idle_total_s=0.55)  # then 0.95 serving: ingest keeps its least share
    assert budget.rate(2.0) == pytest.approx(0.3)
    budget.observe_loop(3.0, idle_total_s=1.55)  # then an idle loop: ingest takes at most idle_share
    assert budget.rate(3.0) == pytest.approx(0.9)
    assert budget.rate(3.3) == 0.3  # readings go stale


def test_serving_share_is_smoothed_over_readings():
    """A reading covering a tenth of ``smooth_s`` moves serving's share a tenth of the way."""
    budget = IngestBudget(share=0.1, idle_share=0.9, reserve=0.0, smooth_s=0.5)
    budget.observe_loop(0.0, 0.0)
    budget.observe_loop(1.0, 1.0)  # idle for a whole second: serving 0
    budget.observe_loop(1.05, 1.0)  # 50 ms with no idle and no ingest: serving 1
    assert budget.serving_share == pytest.approx(0.1)
    assert budget.rate(1.05) == pytest.approx(0.9)


@given(st.lists(st.tuples(st.floats(0.001, 1), st.floats(0, 1), st.floats(0, 1)), max_size=50))
def test_the_rate_stays_between_the_least_and_the_most_share(readings):
    """Whatever the loop reports (even idle and ingest adding up to more than the time passed), the rate
    stays in [share, idle_share]."""
    budget = IngestBudget(share=0.3, idle_share=0.9)
    now = idle = 0.0
    for gap, idle_part, ingest_part in readings:
        budget.charge(now, ingest_part * gap)
        now += gap
        idle += idle_part * gap
        budget.observe_loop(now, idle)
        assert 0.0 <= budget.serving_share <= 1.0
        assert 0.3 <= budget.rate(now) <= 0.9


def test_ingest_takes_the_idle_share_whenever_no_request_is_in_flight():
    serving = [True]
    budget = IngestBudget(share=0.5, idle_share=0.9, burst_s=0.005, serving=lambda: serving[0])
    budget.observe_loop(0.0, 0.0)
    budget.observe_loop(1.0, 0.0)  # a machine with no core free: every second counts as serving
    assert budget.rate(1.0) == 0.5
    serving[0] = False
    assert budget.rate(1.0) == 0.9
