"""A health tick is skipped only when the engine's events and its /metrics answer already said it is up, or when
nobody uses it; never while it is out of rotation, and never more than ``every - 1`` ticks in a row."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.health_ticks import ANSWERED, QUIET, HealthTicks


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(0, 2), st.booleans()),
                                   max_size=80))
def test_a_skipped_tick_had_its_reason_and_no_run_of_skips_reaches_every(every, ticks):
    ticks_ = HealthTicks(every)
    mark, previous, skipped = 0, None, 0
    for routable, active, step, answered in ticks:
        mark += step
        moved, previous = previous is not None and mark != previous, mark
        reason = ticks_.skip(routable=routable, active=active, mark=mark, answered=answered)
        if reason is None:
            skipped = 0
            continue
        skipped += 1
        assert skipped <= every - 1
        assert routable
        if reason == ANSWERED:
            assert moved and answered
        else:
            assert reason == QUIET and not active and not moved


def test_an_active_engine_whose_events_stop_is_polled_at_the_next_tick():
    """The core of an engine with requests on it that dies stops its events: the tick after is polled, as without
    skipping."""
    ticks = HealthTicks(4)
    assert ticks.skip(routable=True, active=True, mark=0, answered=True) is None  # the first mark is not a move
    assert ticks.skip(routable=True, active=True, mark=1, answered=True) == ANSWERED
    assert ticks.skip(routable=True, active=True, mark=2, answered=True) == ANSWERED
    assert ticks.skip(routable=True, active=True, mark=2, answered=True) is None
    assert ticks.skip(routable=True, active=True, mark=3, answered=False) is None  # /metrics did not answer


def test_an_engine_out_of_rotation_or_after_a_failed_poll_is_polled_every_tick():
    ticks = HealthTicks(4)
    assert all(ticks.skip(routable=False, active=False, mark=0, answered=False) is None for _ in range(6))
    assert all(ticks.skip(routable=False, active=True, mark=n, answered=True) is None for n in range(1, 7))


def test_a_quiet_engine_is_polled_once_every_few_ticks_and_every_one_polls_every_tick():
    ticks = HealthTicks(4)
    reasons = [ticks.skip(routable=True, active=False, mark=None, answered=False) for _ in range(8)]
    assert reasons == [QUIET, QUIET, QUIET, None] * 2
    every_tick = HealthTicks(1)
    assert all(every_tick.skip(routable=True, active=False, mark=None, answered=True) is None for _ in range(4))
