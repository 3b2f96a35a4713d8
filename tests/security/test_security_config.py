"""Config validation for [auth] and [[tenants]]: errors name the key and never echo a plain key."""

import re
import tomllib

import pytest

from gateway.config import ConfigError
from gateway.security.config import AuthConfig, TenantConfig, validate_security
from gateway.security.keys import hash_key

KEY_HASH = hash_key("kvm-acme")


def tenant(**overrides) -> TenantConfig:
    return TenantConfig(**{"name": "acme", "keys": [KEY_HASH], **overrides})


def test_issue_example_parses_and_validates():
    table = tomllib.loads(f"""
[auth]
enabled = true
admin_keys = ["{hash_key('kvm-admin')}"]

[[tenants]]
name = "acme"
keys = ["{KEY_HASH}"]
priority = "normal"
cache = "isolated"
requests_per_second = 5
prompt_tokens_per_minute = 200000
""")
    auth = AuthConfig(**table["auth"])
    tenants = [TenantConfig(**t) for t in table["tenants"]]
    validate_security(auth, tenants)
    assert tenants[0].effective_cache_salt().startswith("kvmesh:")


@pytest.mark.parametrize(("overrides", "key"), [
    ({"priority": "urgent"}, "tenants[0].priority"),
    ({"cache": "private"}, "tenants[0].cache"),
    ({"requests_per_second": 0.0}, "tenants[0].requests_per_second"),
    ({"prompt_tokens_per_minute": -5.0}, "tenants[0].prompt_tokens_per_minute"),
    ({"name": "bad name"}, "tenants[0].name"),
    ({"keys": []}, "tenants[0].keys"),
    ({"keys": [KEY_HASH, "sha256:abc"]}, "tenants[0].keys[1]"),
    ({"cache_salt": ""}, "tenants[0].cache_salt"),
])
def test_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match="^" + re.escape(key) + ": "):
        validate_security(AuthConfig(), [tenant(**overrides)])


def test_plain_key_is_refused_without_being_echoed():
    with pytest.raises(ConfigError) as caught:
        validate_security(AuthConfig(), [tenant(keys=["kvm-super-secret-plain-key"])])
    assert "kvmesh keys hash" in str(caught.value)
    assert "super-secret" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"^auth\.admin_keys\[0\]"):
        validate_security(AuthConfig(admin_keys=["kvm-admin-plain"]), [])


def test_cross_tenant_checks():
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.name: tenant 'acme' is defined twice"):
        validate_security(AuthConfig(), [tenant(), tenant(keys=[hash_key("other")])])
    with pytest.raises(ConfigError, match=r"tenants\[1\]\.keys\[0\]: this key already belongs to tenant"):
        same_key_other_case = "sha256:" + KEY_HASH[7:].upper()
        validate_security(AuthConfig(), [tenant(), tenant(name="globex", keys=[same_key_other_case])])
    with pytest.raises(ConfigError, match=r"^auth\.enabled"):
        validate_security(AuthConfig(enabled=True), [])


def test_default_salts_differ_per_tenant_and_explicit_salts_are_namespaced():
    a, b = tenant(cache="isolated"), tenant(name="globex", cache="isolated")
    assert a.effective_cache_salt() != b.effective_cache_salt()
    assert a.effective_cache_salt() == tenant(cache="isolated").effective_cache_salt()
    assert tenant(cache_salt="team-x").effective_cache_salt() == "kvmesh:team-x"


def test_repr_shows_no_key_material():
    text = repr(tenant()) + str(tenant()) + repr(AuthConfig(admin_keys=[KEY_HASH]))
    assert KEY_HASH[7:] not in text and "acme" in text
