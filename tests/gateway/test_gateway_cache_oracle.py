"""Routing details say what the engines hold: only admins see overlaps, estimates and reasons. A tenant,
shared or isolated, sees which engine served it, nothing more."""

from __future__ import annotations

import json

from router_inprocess import MODEL, assert_openai_error, call, make_router

from gateway.security.config import AuthConfig, TenantConfig
from gateway.security.keys import hash_key

ADMIN, OPS, SHARED, ISOLATED = "kvm-admin", "kvm-ops", "kvm-shared", "kvm-isolated"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "what is cached?"}]}).encode()


def router(monkeypatch):
    tenants = [TenantConfig("public", [hash_key(SHARED)], cache="shared"),
               TenantConfig("acme", [hash_key(ISOLATED)]), TenantConfig("ops", [hash_key(OPS)])]
    admins = [hash_key(ADMIN), hash_key(OPS)]
    return make_router(auth=AuthConfig(enabled=True, admin_keys=admins), tenants=tenants)


def as_(key: str) -> dict[str, str]:
    return {"content-type": "application/json", "authorization": f"Bearer {key}"}


async def test_a_shared_tenant_sees_its_engine_but_no_overlap(monkeypatch):
    app = router(monkeypatch)
    answer = await call(app, "POST", "/v1/chat/completions", BODY, as_(SHARED))
    assert answer.status == 200
    header = answer.headers["x-kvmesh-route"]
    assert header.startswith("engine=") and "policy=" in header
    assert not any(word in header for word in ("overlap", "est_ttft", "reason")), header
    assert_openai_error(await call(app, "POST", "/debug/route", BODY, as_(SHARED)), 403)


async def test_an_isolated_tenant_sees_no_routing_details_either(monkeypatch):
    """Its estimates and reasons still count other tenants' KV pressure and queues."""
    app = router(monkeypatch)
    answer = await call(app, "POST", "/v1/chat/completions", BODY, as_(ISOLATED))
    header = answer.headers["x-kvmesh-route"]
    assert answer.status == 200 and header.startswith("engine=")
    assert not any(word in header for word in ("overlap", "est_ttft", "reason")), header
    assert_openai_error(await call(app, "POST", "/debug/route", BODY, as_(ISOLATED)), 403)


async def test_an_admin_sees_routing_details(monkeypatch):
    """On /debug/route without being a tenant; in its route header when its key is also a tenant's."""
    app = router(monkeypatch)
    explained = await call(app, "POST", "/debug/route", BODY, as_(ADMIN))
    assert explained.status == 200 and explained.json()["candidates"]
    answer = await call(app, "POST", "/v1/chat/completions", BODY, as_(OPS))
    assert "overlap=" in answer.headers["x-kvmesh-route"]


def test_tenants_are_isolated_unless_configured_shared():
    assert TenantConfig("newcomer").cache == "isolated"


async def test_debug_route_is_rate_limited_per_client(monkeypatch):
    """Even an admin (everyone, with auth off) gets a small bucket: past it, 429 in OpenAI's shape."""
    app = make_router()
    burst = app.config.admission.debug_route_burst
    for _ in range(burst):
        assert (await call(app, "POST", "/debug/route", BODY)).status == 200
    refused = await call(app, "POST", "/debug/route", BODY)
    assert assert_openai_error(refused, 429)["code"] == "rate_limit_exceeded" and "retry-after" in refused.headers
    assert (await call(app, "POST", "/v1/chat/completions", BODY)).status == 200
