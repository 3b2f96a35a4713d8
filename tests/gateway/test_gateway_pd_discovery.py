"""An engine's P/D role and protocol read from what it reports: vLLM names its kv_transfer_config only at
its development ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``); elsewhere (404) the role is configured. The
answer is untrusted, and a configured role or protocol always wins."""

from __future__ import annotations

import json

import pytest
import trio
from proxy_harness import sim_engines, start_server
from router_inprocess import StubUpstream

from events.counters import ENGINE_TASK_FAILURES
from gateway.config import EngineConfig, RouterConfig
from gateway.disaggregation.roles import parse_server_info
from gateway.engine_watch import Discovery
from gateway.engines import EnginePool, EngineState
from gateway.replica import build_replica
from sim.http_server import HttpRequest, HttpResponse


def info(transfer) -> bytes:
    return json.dumps({"vllm_config": {"kv_transfer_config": transfer}, "vllm_env": {}}).encode()


def test_the_connector_config_names_the_role_and_protocol():
    assert parse_server_info(info({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})) == (
        "prefill", "handoff")
    assert parse_server_info(info({"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"})) == (
        "decode", "opaque")
    assert parse_server_info(info({"kv_connector": "SomeNewConnector", "kv_role": "kv_both"})) == ("both", None)
    assert parse_server_info(info(None)) == ("both", None)  # no connector: whole requests
    for junk in (b"<html>", b"[]", json.dumps({"vllm_config": "VllmConfig(...)"}).encode(),  # the text format
                 info({"kv_connector": "NixlConnector", "kv_role": "kv_leader"}), info(["kv_producer"])):
        with pytest.raises(ValueError):
            parse_server_info(junk)


async def test_a_dev_mode_engine_reports_its_role_and_the_config_overrides_it(nursery, tmp_path):
    (_,), (reported,) = await sim_engines(nursery, 1, server_dev_mode=True, role="prefill",
                                          kv_shared_path=str(tmp_path))
    await Discovery(reported).connector()
    assert (reported.role, reported.kv_protocol) == ("prefill", "opaque")
    url = reported.url
    configured = EngineState("c", EngineConfig(url=url, role="decode"), EnginePool(url))
    await Discovery(configured).connector()
    assert (configured.role, configured.kv_protocol) == ("decode", "opaque")  # the config's role wins
    (_,), (production,) = await sim_engines(nursery, 1, role="prefill")  # no dev mode: 404, as vLLM
    await Discovery(production).connector()
    assert production.reported_role is None and (production.role, production.kv_protocol) == ("both", "handoff")


async def test_a_malformed_report_is_refused_and_counted_by_the_engines_watcher(nursery):
    async def junk(req: HttpRequest) -> HttpResponse:
        if req.path == "/server_info":
            return HttpResponse(200, info({"kv_connector": "NixlConnector", "kv_role": "producer"}))
        if req.path == "/v1/models":
            return HttpResponse(200, b'{"object": "list", "data": [{"id": "m", "object": "model"}]}')
        return HttpResponse(200 if req.path == "/health" else 404, b"")

    server = await start_server(nursery, junk)
    router = build_replica(RouterConfig(engines=[EngineConfig(url=server.url, id="junk")]),
                           forward=StubUpstream()).router
    failures = ENGINE_TASK_FAILURES.labels(engine="junk", task="server_info", reason="ValueError")
    before = failures._value.get()
    nursery.start_soon(router.fleet.run)
    with trio.fail_after(10):
        while failures._value.get() == before:
            await trio.sleep(0.02)
    assert router.engines.get("junk").role == "both"


async def test_the_watcher_takes_a_dev_mode_engines_role(nursery):
    (_,), (sim,) = await sim_engines(nursery, 1, server_dev_mode=True, role="decode")
    router = build_replica(RouterConfig(engines=[EngineConfig(url=sim.url, id="d")]), forward=StubUpstream()).router
    nursery.start_soon(router.fleet.run)
    engine = router.engines.get("d")
    with trio.fail_after(10):
        while engine.reported_role is None:
            await trio.sleep(0.02)
    assert (engine.role, engine.kv_protocol) == ("decode", "handoff")  # NixlConnector
