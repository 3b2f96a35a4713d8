"""Priority shedding: low is shed first (from half the threshold), normal at the threshold, high never."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.decision import Admit, Reject
from gateway.admission.priority import admit, queued_depth, resolve_priority
from gateway.openai_errors import ApiError
from gateway.security.auth import Tenant

depths = st.lists(st.integers(0, 200), max_size=8)
thresholds = st.integers(1, 100)


@given(depths, thresholds)
def test_shedding_order(depths, threshold):
    high, normal, low = (admit(p, depths, threshold) for p in ("high", "normal", "low"))
    assert isinstance(high, Admit)
    if isinstance(low, Admit):
        assert isinstance(normal, Admit)
    if isinstance(normal, Reject):
        assert isinstance(low, Reject)
        assert normal.retry_after_s == 1.0 and normal.error().status == 429


@given(depths, thresholds)
def test_exact_rules(depths, threshold):
    room = min(depths, default=None)
    assert isinstance(admit("normal", depths, threshold), Admit) == (room is None or room < threshold)
    assert isinstance(admit("low", depths, threshold), Admit) == (room is None or room < threshold / 2)


def test_one_engine_with_room_is_enough():
    assert isinstance(admit("normal", [100, 100, 3], 10), Admit)
    assert isinstance(admit("low", [100, 5, 100], 10), Reject)
    assert isinstance(admit("low", [100, 4, 100], 10), Admit)


def test_priority_header_only_when_the_tenant_may_choose():
    fixed = Tenant("a", priority="low")
    chooser = Tenant("b", priority="normal", allow_priority_header=True)
    assert resolve_priority(fixed, "high") == "low"
    assert resolve_priority(chooser, " High ") == "high"
    assert resolve_priority(chooser, None) == "normal"
    with pytest.raises(ApiError) as caught:
        resolve_priority(chooser, "urgent")
    assert caught.value.status == 400 and caught.value.param == "x-priority"


def test_running_requests_are_no_queue_and_unpolled_ones_are():
    assert queued_depth(in_flight=64, running=64, waiting=0) == 0  # a full batch of 64 streams: nothing waits
    assert queued_depth(in_flight=70, running=64, waiting=6) == 6
    assert queued_depth(in_flight=70, running=64, waiting=0) == 6  # sent since the poll: counted as waiting
    assert queued_depth(in_flight=10, running=0, waiting=0) == 10  # no metrics: every request counts
    assert queued_depth(in_flight=64, running=64, waiting=0, finished_since_poll=4) == 4
    assert queued_depth(in_flight=0, running=200, waiting=30) == 30  # other clients' queue


@given(st.integers(0, 500), st.integers(0, 500), st.integers(0, 500), st.integers(0, 500))
def test_queued_depth_counts_the_reported_queue_and_never_more_than_all_known_requests(in_flight, running, waiting,
                                                                                      finished):
    depth = queued_depth(in_flight, running, waiting, finished)
    assert waiting <= depth <= waiting + in_flight
    assert queued_depth(in_flight + 1, running, waiting, finished) >= depth
