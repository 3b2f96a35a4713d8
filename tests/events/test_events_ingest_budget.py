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
    for bad in ({"share": 0}, {"share": 1.5}, {"idle_share": 0}, {"burst_s": 0}, {"slice_s": -1},
                {"share": 0.9, "idle_share": 0.5}, {"raise_step": 0}):
        with pytest.raises(ValueError):
            IngestBudget(**bad)


def test_while_serving_the_share_climbs_on_time_and_halves_when_late():
    budget = IngestBudget(share=0.3, idle_share=0.9, burst_s=0.005, lag_target_s=0.005, raise_step=0.1)
    assert budget.share_now(0.0) == 0.3  # nobody watches the loop yet: the low share
    budget.charge(0.0, 0.014)  # 0.009 s of debt
    assert budget.wait_s(0.0) == pytest.approx(0.030, abs=1e-3)
    for i in range(10):
        budget.observe_lag(i * 0.05, 0.001)
    assert budget.share_now(0.45) == pytest.approx(0.9)  # on time: up to the idle share, a step a reading
    assert budget.wait_s(0.45) == 0.0
    budget.charge(0.45, 0.014)  # the same debt again...
    assert budget.wait_s(0.45) == pytest.approx(0.010, abs=1e-3)  # ...repaid at 0.9 of the loop
    budget.observe_lag(0.5, 0.02)
    assert budget.share_now(0.5) == pytest.approx(0.45)  # one late wake-up halves it...
    budget.observe_lag(0.55, 0.001)
    assert budget.share_now(0.55) == pytest.approx(0.55)  # ...and the next on-time one climbs again
    for i in range(5):
        budget.observe_lag(0.6 + i * 0.05, 0.03)
    assert budget.share_now(0.8) == 0.3  # late again and again: the low share, never less
    assert budget.share_now(0.8 + 0.3) == 0.3  # readings gone stale vouch for nothing


@given(st.lists(st.floats(0, 0.2), min_size=1, max_size=100))
def test_the_serving_share_stays_between_its_bounds_and_falls_with_every_late_reading(lags):
    budget = IngestBudget(share=0.3, idle_share=0.9)
    for i, lag in enumerate(lags):
        before = budget.share_now(i * 0.05)  # the first reading's before: no reading yet, the low share
        budget.observe_lag(i * 0.05, lag)
        after = budget.share_now(i * 0.05)
        assert 0.3 <= after <= 0.9
        assert after < before or after == 0.3 if lag > budget.lag_target_s else after >= before


def test_one_late_reading_in_twenty_leaves_most_of_the_idle_share():
    """Continuous chat makes the odd reading late on its own: ingest keeps most of the loop's idle time, where a
    second at the low share after each late reading kept it at 0.3 throughout."""
    budget = IngestBudget(share=0.3, idle_share=0.9)
    shares = []
    for i in range(200):
        budget.observe_lag(i * 0.05, 0.06 if i % 20 == 19 else 0.001)
        shares.append(budget.share_now(i * 0.05))
    assert sum(shares[40:]) / len(shares[40:]) > 0.75


def test_the_lag_requests_make_on_their_own_leaves_ingest_the_idle_share():
    """Continuous chat alone kept the loop's lag p99 at 10-25 ms: only a reading a whole watch interval late
    (50 ms) says the loop is behind, so requests' own lag does not halve ingest's share over and over."""
    budget = IngestBudget(share=0.3, idle_share=0.9)
    for i in range(40):
        budget.observe_lag(i * 0.05, 0.025 if i % 2 else 0.012)
    assert budget.share_now(40 * 0.05) == pytest.approx(0.9)
    budget.observe_lag(41 * 0.05, 0.06)
    assert budget.share_now(41 * 0.05) == pytest.approx(0.45)


def test_ingest_takes_the_idle_share_whenever_no_request_is_in_flight():
    serving = [True]
    budget = IngestBudget(share=0.5, idle_share=0.9, burst_s=0.005, serving=lambda: serving[0])
    budget.observe_lag(0.0, 0.2)  # a machine with no core free: the loop is late whatever it does
    assert budget.share_now(0.0) == 0.5
    serving[0] = False
    assert budget.share_now(0.0) == 0.9


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
