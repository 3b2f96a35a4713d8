"""Routing details say what the engines hold: only admins see overlaps, estimates and reasons. A tenant,
shared or isolated, sees which engine served it, nothing more."""

from __future__ import annotations

import json

from router_inprocess import MODEL, StubUpstream, assert_openai_error, call, make_router

from gateway.proxy import Attempt, ProxyResult
from gateway.routing import public_engine_name
from gateway.security.config import AuthConfig, TenantConfig
from gateway.security.keys import hash_key

ADMIN, OPS, SHARED, ISOLATED = "kvm-admin", "kvm-ops", "kvm-shared", "kvm-isolated"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "what is cached?"}]}).encode()


def router(monkeypatch, upstream: StubUpstream | None = None):
    tenants = [TenantConfig("public", [hash_key(SHARED)], cache="shared"),
               TenantConfig("acme", [hash_key(ISOLATED)]), TenantConfig("ops", [hash_key(OPS)])]
    admins = [hash_key(ADMIN), hash_key(OPS)]
    return make_router(upstream, auth=AuthConfig(enabled=True, admin_keys=admins), tenants=tenants)


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


class SecondEngineAnswers(StubUpstream):
    """The first choice failed; the second engine served (the header then names both)."""

    async def __call__(self, engines, exchange, max_attempts: int) -> ProxyResult:
        attempts = [Attempt(engines[0].id, "status 503", 503), Attempt(engines[1].id, "ok", 200)]
        await exchange.send({"type": "http.response.start", "status": 200,
                             "headers": exchange.route_header(engines[1], attempts)})
        await exchange.send({"type": "http.response.body", "body": b"{}", "more_body": False})
        return ProxyResult(engine=engines[1], status=200, ttft_s=0.001, attempts=attempts)


async def test_a_tenant_is_told_stable_engine_names_never_addresses(monkeypatch):
    app = router(monkeypatch, SecondEngineAnswers())
    ids = [e.id for e in app.engines.all()]
    assert all(id_.startswith("127.0.0.1:") for id_ in ids)
    names = {public_engine_name(id_) for id_ in ids}
    for key in (SHARED, ISOLATED):
        header = (await call(app, "POST", "/v1/chat/completions", BODY, as_(key))).headers["x-kvmesh-route"]
        fields = dict(part.strip().split("=", 1) for part in header.split(";"))
        assert {fields["engine"], fields["served_by"]} == names and "127.0.0.1" not in header, header
    assert names == {public_engine_name(id_) for id_ in ids}, "the same name every time"
    admin_header = (await call(app, "POST", "/v1/chat/completions", BODY, as_(OPS))).headers["x-kvmesh-route"]
    assert "served_by=127.0.0.1:" in admin_header, "an admin keeps the engine's id"
