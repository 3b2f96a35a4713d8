"""Isolated tenants always carry their own cache_salt; shared tenants keep the client's bytes and salt."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.openai_errors import ApiError
from gateway.security.auth import ANONYMOUS, Tenant
from gateway.security.config import TenantConfig
from gateway.security.isolation import apply_cache_policy
from gateway.security.keys import hash_key

ISOLATED = Tenant.from_config(TenantConfig("acme", [hash_key("a")], cache="isolated"))
OTHER = Tenant.from_config(TenantConfig("globex", [hash_key("g")], cache="isolated"))
SHARED = Tenant.from_config(TenantConfig("public", [hash_key("p")], cache="shared"))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
bodies = st.dictionaries(st.text(max_size=8), json_values, max_size=5).map(
    lambda d: {"model": "m", "messages": [{"role": "user", "content": "hi"}], **d})
client_salts = st.one_of(st.none(), st.text(max_size=12).filter(lambda s: not s.startswith("kvmesh:")))


def with_salt(body: dict, salt: str | None) -> dict:
    body = {k: v for k, v in body.items() if k != "cache_salt"}
    return body if salt is None else {**body, "cache_salt": salt}


@given(bodies, client_salts)
def test_isolated_tenant_salt_always_wins(body, salt):
    body = with_salt(body, salt)
    raw = json.dumps(body).encode()
    new_body, new_raw, effective = apply_cache_policy(ISOLATED, body, raw)
    assert effective == ISOLATED.cache_salt != OTHER.cache_salt
    assert json.loads(new_raw) == new_body == {**body, "cache_salt": ISOLATED.cache_salt}


@given(bodies, client_salts)
def test_shared_tenant_keeps_client_bytes_and_salt(body, salt):
    body = with_salt(body, salt)
    raw = json.dumps(body).encode()
    new_body, new_raw, effective = apply_cache_policy(SHARED, body, raw)
    assert new_raw is raw and new_body is body and effective == salt


def test_already_salted_isolated_body_is_not_reserialised():
    body = {"model": "m", "cache_salt": ISOLATED.cache_salt}
    raw = b'{"model": "m",   "cache_salt": "%s"}' % ISOLATED.cache_salt.encode()
    assert apply_cache_policy(ISOLATED, body, raw)[1] is raw


@pytest.mark.parametrize("tenant", [SHARED, ANONYMOUS])
def test_shared_tenants_cannot_present_a_tenant_salt(tenant):
    body = {"model": "m", "cache_salt": ISOLATED.cache_salt}
    with pytest.raises(ApiError) as caught:
        apply_cache_policy(tenant, body, json.dumps(body).encode())
    assert caught.value.status == 400 and caught.value.param == "cache_salt"


@pytest.mark.parametrize("tenant", [SHARED, ISOLATED])
def test_non_string_salt_is_a_400(tenant):
    with pytest.raises(ApiError) as caught:
        apply_cache_policy(tenant, {"cache_salt": 5}, b'{"cache_salt": 5}')
    assert caught.value.status == 400
