"""Bearer keys resolve to tenants by hash; admin paths need an admin key; keys never leak into objects."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.openai_errors import ApiError
from gateway.security.auth import ANONYMOUS, Authenticator, Tenant, bearer_token
from gateway.security.config import AuthConfig, TenantConfig
from gateway.security.keys import hash_key

ACME_KEY, GLOBEX_KEY, ADMIN_KEY = "kvm-acme-1", "kvm-globex-1", "kvm-admin-1"
keys = st.text(st.characters(min_codepoint=33, max_codepoint=0x10FFFF, exclude_categories=("Cs", "Zs")),
               min_size=1, max_size=60)


def tenants() -> list[TenantConfig]:
    return [
        TenantConfig("acme", [hash_key(ACME_KEY), hash_key("kvm-acme-2")], priority="high", cache="isolated",
                     requests_per_second=5, prompt_tokens_per_minute=200000),
        TenantConfig("globex", [hash_key(GLOBEX_KEY)], priority="low", allow_priority_header=True),
    ]


def authenticator(enabled: bool = True) -> Authenticator:
    return Authenticator(AuthConfig(enabled, [hash_key(ADMIN_KEY)]), tenants())


def test_valid_keys_resolve_to_their_tenant_with_resolved_settings():
    auth = authenticator()
    acme = auth.resolve(f"Bearer {ACME_KEY}")
    assert acme == auth.resolve("bearer  kvm-acme-2 ")
    assert (acme.name, acme.priority, acme.cache, acme.requests_per_second) == ("acme", "high", "isolated", 5)
    assert acme.cache_salt == tenants()[0].effective_cache_salt()
    globex = auth.resolve(f"Bearer {GLOBEX_KEY}")
    assert (globex.name, globex.allow_priority_header) == ("globex", True)
    # No cache policy given: isolated, so no other tenant can probe what globex's prompts left cached.
    assert globex.cache == "isolated" and globex.cache_salt not in (None, acme.cache_salt)


@given(keys)
def test_any_other_key_resolves_to_nothing(key):
    auth = authenticator()
    expected = {ACME_KEY: "acme", "kvm-acme-2": "acme", GLOBEX_KEY: "globex"}.get(key)
    tenant = auth.resolve(f"Bearer {key}")
    assert (tenant.name if tenant else None) == expected
    assert auth.is_admin(f"Bearer {key}") == (key == ADMIN_KEY)


@given(st.one_of(st.none(), st.text(max_size=80), st.binary(max_size=40).map(lambda b: b.decode("latin-1"))))
def test_malformed_headers_never_raise_and_never_authenticate(header):
    auth = authenticator()
    assert auth.resolve(header) is None or bearer_token(header) in (ACME_KEY, "kvm-acme-2", GLOBEX_KEY)
    assert auth.is_admin(header) == (bearer_token(header) == ADMIN_KEY)


def test_missing_and_wrong_keys_get_openai_shaped_401_without_the_key():
    auth = authenticator()
    with pytest.raises(ApiError) as missing:
        auth.authenticate(None)
    with pytest.raises(ApiError) as wrong:
        auth.authenticate("Bearer kvm-guessed-secret")
    for error, code in ((missing.value, "missing_api_key"), (wrong.value, "invalid_api_key")):
        body = json.loads(error.body())
        assert error.status == 401 and body["error"]["type"] == "authentication_error"
        assert body["error"]["code"] == code and "guessed-secret" not in error.body().decode()
    assert auth.authenticate(f"Bearer {ACME_KEY}").name == "acme"


def test_admin_paths_need_the_admin_key():
    auth = authenticator()
    auth.require_admin(f"Bearer {ADMIN_KEY}")
    with pytest.raises(ApiError) as tenant_key:
        auth.require_admin(f"Bearer {ACME_KEY}")
    assert tenant_key.value.status == 403
    with pytest.raises(ApiError) as no_key:
        auth.require_admin(None)
    assert no_key.value.status == 401
    assert auth.resolve(f"Bearer {ADMIN_KEY}") is None


def test_auth_disabled_gives_the_anonymous_tenant_and_open_admin():
    auth = authenticator(enabled=False)
    assert auth.resolve(None) is ANONYMOUS and auth.resolve("Bearer whatever") is ANONYMOUS
    assert auth.is_admin(None)
    assert ANONYMOUS.cache == "shared" and ANONYMOUS.requests_per_second is None


def test_no_key_material_in_tenant_or_authenticator_text():
    auth = authenticator()
    tenant = auth.resolve(f"Bearer {ACME_KEY}")
    text = " ".join([repr(tenant), str(tenant), repr(auth), repr(vars(auth)), json.dumps(Tenant.__slots__)])
    for key in (ACME_KEY, "kvm-acme-2", GLOBEX_KEY, ADMIN_KEY):
        assert key not in text and hash_key(key)[7:] not in text
