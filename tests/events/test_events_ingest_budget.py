"""The event-loop share of KV-event ingest: bounded on average and per burst, never starved for good."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from events.counters import INGEST_DEFERRED
from events.feed import EngineFeed
from events.ingest_budget import IngestBudget
from events.socket_drain import wait_for_budget
from index.prefix_index import PrefixIndex
from index.view import CacheView


def test_a_fresh_budget_allows_one_burst_then_defers_until_refilled():
    budget = IngestBudget(share=0.5, burst_s=0.02)
    assert budget.wait_s(0.0) == 0.0
    budget.charge(0.0, 0.03)  # a slice overran the burst
    wait = budget.wait_s(0.0)
    assert wait == pytest.approx(0.02, abs=1e-3)  # 0.01 s of debt at half a second per second
    assert budget.wait_s(wait / 2) == pytest.approx(wait / 2, abs=1e-3)  # asked again halfway: the rest
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


def test_ingest_takes_more_of_the_loop_only_while_the_loop_runs_on_time():
    budget = IngestBudget(share=0.5, idle_share=0.9, burst_s=0.005, lag_target_s=0.005, hold_s=1.0)
    budget.charge(0.0, 0.014)  # 0.009 s of debt
    assert budget.wait_s(0.0) == pytest.approx(0.018, abs=1e-3)  # nobody watches the loop: the low share
    budget.observe_lag(0.0, 0.001)
    assert budget.wait_s(0.0) == pytest.approx(0.010, abs=1e-3)  # on time: the loop's idle time
    budget.observe_lag(0.01, 0.02)
    assert budget.wait_s(0.01) == pytest.approx(0.008, abs=1e-3)  # late: the low share (idle: no wait)...
    budget.observe_lag(0.9, 0.001)
    assert not budget.headroom(0.9)  # ...held for a second after the last late wake-up
    budget.observe_lag(1.02, 0.001)
    assert budget.headroom(1.02) and not budget.headroom(1.5)  # and only while readings are fresh


def test_ingest_takes_the_idle_share_whenever_no_request_is_in_flight():
    serving = [True]
    budget = IngestBudget(share=0.5, idle_share=0.9, burst_s=0.005, serving=lambda: serving[0])
    budget.observe_lag(0.0, 0.2)  # a machine with no core free: the loop is late whatever it does
    assert not budget.headroom(0.0)
    serving[0] = False
    assert budget.headroom(0.0)


async def test_the_time_ingest_waits_for_the_budget_is_counted_as_waited(autojump_clock):
    """``wait_for_budget`` asks the budget again after each sleep (a replay may have spent the refill meanwhile); the
    seconds it waited in all are counted for every engine whose events queued meanwhile."""
    view = CacheView(PrefixIndex())
    view.register("waiting-engine", block_size=4, has_events=True)
    feed = EngineFeed("waiting-engine", "tiny", view)
    budget = IngestBudget(share=0.5, burst_s=0.02)
    budget.charge(trio.current_time(), 0.03)
    first_wait = budget.wait_s(trio.current_time())
    counter = INGEST_DEFERRED.labels(engine="waiting-engine")
    before = counter._value.get()

    async def replay_spends_the_refill() -> None:
        await trio.sleep(first_wait / 2)
        budget.charge(trio.current_time(), 0.01)

    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replay_spends_the_refill)
        await wait_for_budget(budget, [(feed, trio.current_time)])
    waited = trio.current_time() - began
    assert waited > first_wait * 1.5
    assert counter._value.get() - before == pytest.approx(waited)
