"""Token bucket: never more than rate * T + capacity over any interval, and its wait times are honest."""

from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.token_bucket import TokenBucket

arrivals = st.lists(st.tuples(st.floats(0, 2.0), st.floats(0.1, 5.0)), min_size=1, max_size=150)


@given(st.floats(0.5, 20), st.floats(1, 20), arrivals)
def test_admits_at_most_rate_times_interval_plus_capacity(rate, capacity, arrivals):
    bucket = TokenBucket.full(rate, capacity, 0.0)
    now, admitted = 0.0, []
    for gap, cost in arrivals:
        now += gap
        if bucket.wait_time(cost, now) == 0.0:
            bucket.take(cost, now)
            admitted.append((now, cost))
    for i, (start, _) in enumerate(admitted):
        total = 0.0
        for end, cost in admitted[i:]:
            total += cost
            assert total <= rate * (end - start) + capacity + 1e-6


@given(st.floats(0.5, 20), st.floats(1, 20), arrivals)
def test_waiting_the_returned_time_is_enough(rate, capacity, arrivals):
    bucket = TokenBucket.full(rate, capacity, 0.0)
    now = 0.0
    for gap, cost in arrivals:
        now += gap
        wait = bucket.wait_time(cost, now)
        if wait is None:
            assert cost > capacity
            continue
        now += wait
        assert bucket.wait_time(cost - 1e-6, now) == 0.0
        bucket.take(cost, now)


def test_backwards_clock_does_not_refill():
    bucket = TokenBucket.full(1.0, 2.0, 10.0)
    bucket.take(2.0, 10.0)
    assert bucket.wait_time(1.0, 5.0) == 1.0
