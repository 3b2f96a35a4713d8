"""Circuit breaker transitions with exponential backoff, and the combined engine-health verdict."""

import copy

from hypothesis import given
from hypothesis import strategies as st

from gateway.breaker import CircuitBreaker, EngineHealth


def test_closed_to_open_after_consecutive_failures():
    breaker = CircuitBreaker(failure_threshold=3)
    for _ in range(2):
        breaker.record_failure(0.0, "timeout")
    breaker.record_success(0.0)
    for _ in range(2):
        breaker.record_failure(0.0, "timeout")
    assert breaker.allow(0.0) and breaker.state_code() == 0
    breaker.record_failure(0.0, "timeout")
    assert not breaker.allow(0.5) and breaker.state_code() == 2 and breaker.last_cause == "timeout"


def test_error_rate_opens_only_with_a_full_window():
    breaker = CircuitBreaker(failure_threshold=100, error_rate_threshold=0.5, window=10)
    for i in range(9):
        if i % 2:
            breaker.record_failure(0.0, "5xx")
        else:
            breaker.record_success(0.0)
    assert breaker.state == "closed"
    breaker.record_failure(0.0, "5xx")
    assert breaker.state == "open"


def test_open_half_open_closed_and_doubling_backoff():
    breaker = CircuitBreaker(failure_threshold=1, open_base_s=1.0, open_max_s=5.0)
    breaker.record_failure(10.0, "reset")
    assert not breaker.allow(10.99)
    assert breaker.state_code(11.0) == 1
    assert breaker.allow(11.0) and not breaker.allow(11.0)
    breaker.record_failure(11.1, "reset")
    assert breaker.open_for == 2.0 and not breaker.available(13.0) and breaker.available(13.1)
    breaker.allow(13.1)
    breaker.record_failure(13.2, "reset")
    breaker.allow(17.2)
    breaker.record_failure(17.3, "reset")
    assert breaker.open_for == 5.0
    assert breaker.allow(22.3)
    breaker.record_success(22.4)
    assert breaker.state_code() == 0 and breaker.opens == 0
    breaker.record_failure(23.0, "reset")
    assert breaker.open_for == 1.0


def test_a_lost_probe_frees_its_slot_after_the_probe_timeout():
    breaker = CircuitBreaker(failure_threshold=1, open_base_s=1.0, probe_timeout_s=5.0)
    breaker.record_failure(0.0, "reset")
    assert breaker.allow(1.0) and not breaker.available(5.9)
    assert breaker.allow(6.0)


def test_an_abstaining_probe_frees_its_slot_and_moves_nothing():
    """A probe answered with the request's own fault (or 429) neither closes nor re-opens the breaker."""
    breaker = CircuitBreaker(failure_threshold=1, open_base_s=1.0)
    breaker.record_failure(0.0, "reset")
    assert breaker.allow(1.0) and not breaker.available(1.0)
    breaker.abstain(1.0)
    assert breaker.state == "half_open" and breaker.allow(1.0)
    closed = CircuitBreaker(failure_threshold=2)
    closed.record_failure(0.0, "reset")
    closed.abstain(0.0)
    closed.record_failure(0.0, "reset")
    assert closed.state == "open"


def test_late_outcomes_while_open_change_nothing():
    breaker = CircuitBreaker(failure_threshold=1, open_base_s=4.0)
    breaker.record_failure(0.0, "reset")
    breaker.record_success(1.0)
    breaker.record_failure(2.0, "late")
    assert breaker.state == "open" and breaker.open_until == 4.0 and breaker.last_cause == "reset"


events = st.lists(st.tuples(st.floats(0, 3), st.sampled_from(["allow", "ok", "fail"])), max_size=80)


@given(events)
def test_invariants_under_any_sequence(sequence):
    breaker = CircuitBreaker(failure_threshold=3, window=6, open_base_s=0.5, open_max_s=4.0)
    now, last_open_for = 0.0, 0.0
    for gap, action in sequence:
        now += gap
        was_open = breaker.state == "open" and now < breaker.open_until
        if action == "allow":
            allowed = breaker.allow(now)
            assert not (was_open and allowed)
        elif action == "ok":
            breaker.record_success(now)
        else:
            state = breaker.state_code(now)
            breaker.record_failure(now, "x")
            if state == 1:
                assert breaker.state == "open"
                assert breaker.open_for == min(4.0, 2 * last_open_for)
        if breaker.state == "open":
            assert 0.5 <= breaker.open_for <= 4.0
            last_open_for = breaker.open_for


@given(events, st.lists(st.floats(0, 10), max_size=6))
def test_reading_the_breaker_changes_nothing(sequence, reads):
    """Health is read all the time (routing, /ready, metrics): a read at any time, on any clock, leaves the
    breaker as it was, and says what ``allow`` would then do."""
    breaker = CircuitBreaker(failure_threshold=2, window=4, open_base_s=0.5, half_open_probes=1, probe_timeout_s=1)
    now = 0.0
    for gap, action in sequence:
        now += gap
        {"allow": breaker.allow, "ok": breaker.record_success,
         "fail": lambda t: breaker.record_failure(t, "x")}[action](now)
    for later in reads:
        before = copy.deepcopy(vars(breaker))
        available, _, _ = breaker.available(now + later), breaker.state_code(now + later), breaker.state_at(now + later)
        assert vars(breaker) == before
        assert available == copy.deepcopy(breaker).allow(now + later)

def healthy() -> EngineHealth:
    health = EngineHealth(CircuitBreaker(failure_threshold=1), health_failures_down=2, metric_failures_down=2)
    health.record_health(True)
    return health


def test_not_routable_until_the_first_health_check():
    health = EngineHealth()
    assert health.status(0.0) == (False, "awaiting first health check")
    health.record_health(True)
    assert health.status(0.0) == (True, "ok")


def test_health_polls_need_consecutive_failures():
    health = healthy()
    health.record_health(False, "connection refused")
    assert health.routable(0.0)
    health.record_health(False, "connection refused")
    assert health.status(0.0) == (False, "health check failed 2 times (connection refused)")
    health.record_health(True)
    assert health.routable(0.0)


def test_breaker_state_is_part_of_the_verdict():
    health = healthy()
    health.breaker.record_failure(0.0, "502")
    assert health.status(0.5) == (False, "circuit open after 502")
    assert health.routable(1.0)


def test_failing_metric_polls_degrade_but_never_remove():
    health = healthy()
    for _ in range(10):
        health.record_metrics(False, "timeout")
    assert health.status(10.0) == (True, "metrics failing (timeout)")
    health.record_metrics(True)
    assert health.status(10.0) == (True, "ok")

