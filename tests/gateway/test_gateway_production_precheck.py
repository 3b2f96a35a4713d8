"""The admission pre-check the router runs before tokenizing: same verdicts as admission, no charge."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.config import AdmissionConfig
from gateway.admission.decision import Admit
from gateway.admission.ratelimit import RateLimiter
from gateway.config import EngineConfig, RouterConfig
from gateway.engines import EngineRegistry
from gateway.gatekeeper import Gatekeeper
from gateway.metrics import RouterMetrics
from gateway.openai_errors import ApiError
from gateway.request_body import parse_request
from gateway.security.auth import Tenant
from gateway.security.config import TenantConfig

METERED = Tenant("metered", requests_per_second=2.0, prompt_tokens_per_minute=600.0)
# (seconds since the previous step, prompt tokens, check first?)
steps = st.lists(st.tuples(st.floats(0, 2), st.integers(0, 400), st.booleans()), max_size=60)


@settings(max_examples=200, deadline=None)
@given(steps)
def test_checks_charge_nothing_and_agree_with_a_one_token_admit(schedule):
    checked, plain = RateLimiter("r", AdmissionConfig()), RateLimiter("r", AdmissionConfig())
    now = 1_000_000.0
    for gap, tokens, check_first in schedule:
        now += gap
        if check_first:
            probe = copy.deepcopy(checked)
            assert isinstance(checked.check(METERED, now), Admit) == isinstance(probe.admit(METERED, now, 1), Admit)
        assert type(checked.admit(METERED, now, tokens)) is type(plain.admit(METERED, now, tokens))


ONE_PER_SECOND = TenantConfig("metered", keys=["sha256:" + "0" * 64], requests_per_second=1.0)


def gatekeeper(threshold: int = 4) -> tuple[Gatekeeper, RouterMetrics]:
    config = RouterConfig(tenants=[ONE_PER_SECOND], admission=AdmissionConfig(queue_threshold=threshold))
    metrics = RouterMetrics()
    return Gatekeeper(config, metrics, "r"), metrics


def test_precheck_refuses_an_exhausted_tenant_without_charging():
    gate, metrics = gatekeeper()
    tenant = Tenant.from_config(ONE_PER_SECOND)
    gate.precheck(tenant, "normal", [])
    gate.precheck(tenant, "normal", [])  # checks charge nothing: the bucket still holds its one request
    gate.admit(tenant, "normal", parse_request(b'{"model":"m","prompt":"hi"}', "completion"), 10, [])
    with pytest.raises(ApiError) as refused:
        gate.precheck(tenant, "normal", [])
    assert refused.value.status == 429 and refused.value.retry_after is not None
    assert metrics.admission_rejections.labels("rate_limited", "normal")._value.get() == 1


async def test_precheck_sheds_like_admission():
    gate, metrics = gatekeeper(threshold=4)
    registry = EngineRegistry()
    engine = registry.add(EngineConfig(url="http://127.0.0.1:9", model="m"))
    engine.health.record_health(True)
    engine.in_flight = 2
    with pytest.raises(ApiError) as shed:
        gate.precheck(Tenant("anyone"), "low", [engine])
    assert shed.value.status == 429 and shed.value.code == "overloaded"
    gate.precheck(Tenant("anyone"), "normal", [engine])
    engine.in_flight = 4
    with pytest.raises(ApiError):
        gate.precheck(Tenant("anyone"), "normal", [engine])
    gate.precheck(Tenant("anyone"), "high", [engine])
