"""Per-client buckets: each client gets its own burst, the table stays bounded, a refusal says how long."""

from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.client_buckets import ClientBuckets
from gateway.admission.decision import ADMIT, Reject


def test_a_client_gets_its_burst_then_waits_and_others_are_unaffected():
    buckets = ClientBuckets(rate=2.0, burst=3)
    assert [buckets.admit("a", 0.0, "x") for _ in range(3)] == [ADMIT] * 3
    refused = buckets.admit("a", 0.0, "x")
    assert isinstance(refused, Reject) and refused.retry_after_s == 0.5
    assert buckets.admit("b", 0.0, "x") is ADMIT
    assert buckets.admit("a", 0.5, "x") is ADMIT


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0, 100)), max_size=300))
def test_the_table_never_holds_more_than_its_bound(calls):
    buckets = ClientBuckets(rate=1.0, burst=2, max_clients=8)
    for client, now in sorted(calls, key=lambda c: c[1]):
        buckets.admit(str(client), now, "x")
        assert len(buckets._buckets) <= 8
