"""Priority shedding: low is shed first (from half the threshold), normal at the threshold, high never."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.decision import Admit, Reject
from gateway.admission.priority import admit, resolve_priority
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
