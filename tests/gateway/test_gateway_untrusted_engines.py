"""One bad engine never takes the router down: a router with one engine of each bad kind next to a good
simulated engine keeps serving, and the bad ones are counted and kept out of rotation."""

from __future__ import annotations

import json

import pytest
import trio
from gateway_http import MODEL, chat
from prometheus_client import REGISTRY
from untrusted_engines import HEALTHY, asgi, serve_canned

from gateway.config import EngineConfig, RouterConfig
from gateway.engine_watch import watch_engine
from gateway.engines import EngineState
from gateway.replica import build_replica, run_replica
from gateway.upstream import EnginePool
from sim.config import EngineConfig as SimEngineConfig
from sim.config import FleetConfig
from sim.fleet import run_fleet

pytestmark = pytest.mark.integration

MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
DEEP = b"[" * 100_000 + b"]" * 100_000
SOURCES_SURROGATE = b'{"0": {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "\\ud800"}}'

COMPLETION = json.dumps({"id": "c", "object": "chat.completion", "model": MODEL, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
LIAR_METRICS = (b'vllm:num_requests_running 0\n'
                b'vllm:cache_config_info{block_size="16",num_gpu_blocks="1e308"} 1\n')

BAD_ENGINES = {
    "models-null": {**HEALTHY, "/v1/models": b'{"object": "list", "data": null}'},
    "models-five": {**HEALTHY, "/v1/models": b'{"data": 5}'},
    "models-deep": {**HEALTHY, "/v1/models": DEEP},
    "sources-deep": {**HEALTHY, "/v1/models": MODELS, "/kv_event_sources": DEEP},
    "sources-surrogate": {**HEALTHY, "/v1/models": MODELS, "/kv_event_sources": SOURCES_SURROGATE},
}
LIAR = {**HEALTHY, "/v1/models": MODELS, "/metrics": LIAR_METRICS, "/v1/chat/completions": COMPLETION}
"""Serves, but claims 1e308 KV blocks: it stays in rotation, and deciding between it and others still works."""


def failures(engine: str, task: str) -> float:
    samples = [s for m in REGISTRY.collect() if m.name == "kvmesh_engine_task_failures"
               for s in m.samples if s.name.endswith("_total") and s.labels["engine"] == engine
               and s.labels["task"] == task]
    return sum(s.value for s in samples)


def rejected(engine: str) -> float:
    labels = {"engine": engine, "value": "num_gpu_blocks"}
    return REGISTRY.get_sample_value("kvmesh_engine_values_rejected_total", labels) or 0.0


async def test_router_keeps_serving_next_to_engines_that_answer_garbage():
    async with trio.open_nursery() as nursery:
        sims = await nursery.start(run_fleet, FleetConfig(engines=1, engine=SimEngineConfig(profile="fast")))
        good = sims[0].info.url
        engines = [EngineConfig(url=good, id="good")]
        for name, answers in BAD_ENGINES.items():
            port = await nursery.start(serve_canned, answers)
            engines.append(EngineConfig(url=f"http://127.0.0.1:{port}", id=name))
        port = await nursery.start(serve_canned, LIAR)
        engines.append(EngineConfig(url=f"http://127.0.0.1:{port}", id="liar"))
        replica = build_replica(RouterConfig(engines=engines, metrics_interval_s=0.1, policy="kv_aware"))
        router = replica.router
        await nursery.start(run_replica, replica)

        with trio.fail_after(30):
            while failures("models-five", "discovery") < 2 or failures("sources-surrogate", "discovery") < 1 \
                    or failures("models-deep", "discovery") < 1 or failures("sources-deep", "discovery") < 1 \
                    or not router.engines.get("good").routable or not router.engines.get("liar").routable \
                    or rejected("liar") < 1:
                await trio.sleep(0.05)
        for i in range(6):
            status, body = await asgi(router, "POST", "/v1/chat/completions", chat(f"still serving {i}"))
            assert status == 200, body
        assert sorted(e.id for e in router.engines.all() if e.routable) == ["good", "liar"]
        assert router.engines.get("liar").load.num_blocks is None
        status, body = await asgi(router, "POST", "/admin/engines", {"url": "http://ü@127.0.0.1:9"})
        assert status == 400 and b"engine.url" in body
        with pytest.raises(ValueError, match="ASCII"):
            router.fleet.add(EngineConfig(url="http://ü@127.0.0.1:9"))  # as the replicated registry would
        nursery.cancel_scope.cancel()


async def test_a_watcher_survives_an_exception_nobody_expected():
    """A pool that raises what no upstream error is (UnicodeEncodeError, as a non-ASCII URL once did while
    building the Host header): caught, counted, the engine stays out of rotation, the watcher retries."""

    class Planner:
        reads_events = True

    class ExplodingPool(EnginePool):
        async def get(self, *args, **kwargs):
            raise UnicodeEncodeError("ascii", "\u00fc", 0, 1, "ordinal not in range(128)")

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_canned, HEALTHY)
        url = f"http://127.0.0.1:{port}"
        engine = EngineState("bad-url", EngineConfig(url=url), ExplodingPool(url))
        with trio.move_on_after(1.0):
            await watch_engine(engine, Planner(), ingest=None, interval_s=0.05)
        nursery.cancel_scope.cancel()
    assert failures("bad-url", "health") >= 2
    assert not engine.routable and "UnicodeEncodeError" in engine.health.reason(0.0)
