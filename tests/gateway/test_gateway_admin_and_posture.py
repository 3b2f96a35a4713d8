"""Admin settings are type-checked before they are replicated; an open router says so at start-up."""

from __future__ import annotations

import json
import logging

import pytest
import trio
from router_inprocess import assert_openai_error, call, make_router

from gateway.config import MeshConfig, RouterConfig
from gateway.mesh_link import registry_settings
from gateway.security.config import AuthConfig
from gateway.security.posture import log_posture


@pytest.mark.parametrize("body", [{"draining": "false"}, {"maintenance": 0}, {"draining": None},
                                  {"island": 5}, {"zone": "x" * 65}, {"island": "a\nb"}, {"island": ""}])
async def test_engine_settings_of_the_wrong_type_are_refused(monkeypatch, body):
    router = make_router()
    engine = router.engines.all()[0]
    answer = await call(router, "PATCH", f"/admin/engines/{engine.id}", json.dumps(body).encode())
    assert assert_openai_error(answer, 400)["param"] == next(iter(body))
    assert engine.draining is False and engine.maintenance is False and engine.config.island is None


@pytest.mark.parametrize("island", ["x" * 64, "x" * 65, "rack a", "a\tb", "", None])
async def test_an_added_engine_carries_only_an_island_every_peer_accepts(island):
    """The island of an engine added through the admin API is checked with the rule peers apply to the
    replicated entry: before, a 65-character island was accepted here and refused by every peer."""
    router = make_router()
    before = {e.id for e in router.engines.all()}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(router.fleet.run)  # where the added engine's watcher runs
        answer = await call(router, "POST", "/admin/engines",
                            json.dumps({"url": "http://127.0.0.1:9", "id": "added", "island": island}).encode())
        nursery.cancel_scope.cancel()
    try:
        registry_settings({"island": island})
        peers_accept = True
    except ValueError:
        peers_accept = False
    if peers_accept:
        assert answer.status == 201 and router.engines.get("added").config.island == island
    else:
        assert assert_openai_error(answer, 400)["param"] == "engine.island"
        assert {e.id for e in router.engines.all()} == before


@pytest.mark.parametrize("path", ["drain", "maintenance"])
async def test_drain_and_maintenance_take_only_booleans(monkeypatch, path):
    router = make_router()
    engine = router.engines.all()[0]
    url = f"/admin/engines/{engine.id}/{path}"
    assert_openai_error(await call(router, "POST", url, b'{"enabled": "false"}'), 400)
    assert not engine.draining and not engine.maintenance
    assert (await call(router, "POST", url, b'{"enabled": false}')).status == 200
    assert not engine.draining and not engine.maintenance
    assert (await call(router, "POST", url, b"")).status == 200
    assert engine.draining or engine.maintenance


async def test_valid_settings_still_apply(monkeypatch):
    router = make_router()
    engine = router.engines.all()[0]
    body = {"draining": True, "island": "rack a", "zone": None}
    assert (await call(router, "PATCH", f"/admin/engines/{engine.id}", json.dumps(body).encode())).status == 200
    assert engine.draining is True and engine.config.island == "rack a"


async def test_isolate_refuses_a_string_flag(monkeypatch):
    answer = await call(make_router(), "POST", "/admin/mesh/isolate", b'{"isolated": "no"}')
    assert_openai_error(answer, 400)


def posture(caplog, config: RouterConfig) -> dict[str, dict]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvmesh.security"):
        log_posture(config)
    return {r.surface: vars(r) for r in caplog.records if r.message == "open surface"}


def test_an_open_router_lists_every_surface_and_how_to_close_it(caplog):
    surfaces = posture(caplog, RouterConfig(host="0.0.0.0", mesh=MeshConfig(bind="0.0.0.0:7946")))
    assert set(surfaces) == {"/v1/chat/completions, /v1/completions, /v1/models", "/admin/engines",
                             "/debug/route", "/admin/mesh/isolate", "/metrics", "mesh 0.0.0.0:7946"}
    assert all(s["close"] and s["allows"] for s in surfaces.values())
    assert surfaces["/admin/engines"]["reachable_by"] == "anyone who reaches 0.0.0.0:8000"
    assert "enabled = true" in surfaces["/admin/engines"]["close"]
    local = posture(caplog, RouterConfig(host="127.0.0.1"))
    assert local["/admin/engines"]["reachable_by"] == "this host only" and "/admin/mesh/isolate" not in local


def test_auth_on_leaves_only_the_metrics_port_to_mention(caplog):
    secured = AuthConfig(enabled=True, admin_keys=["sha256:" + "0" * 64])
    assert set(posture(caplog, RouterConfig(host="0.0.0.0", auth=secured))) == {"/metrics"}
    assert posture(caplog, RouterConfig(host="127.0.0.1", auth=secured)) == {}


def test_opting_into_an_open_network_is_said_once_and_loudly(caplog):
    posture(caplog, RouterConfig(host="0.0.0.0", auth=AuthConfig(allow_open_network=True)))
    loud = [r for r in caplog.records if "allow_open_network" in r.getMessage()]
    assert len(loud) == 1 and loud[0].levelno == logging.WARNING
    posture(caplog, RouterConfig(host="127.0.0.1"))
    assert not [r for r in caplog.records if "allow_open_network" in r.getMessage()]
