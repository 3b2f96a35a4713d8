"""Per-engine background tasks: discover models and event endpoints, poll health and /metrics, subscribe.

watch_engine(engine)
 +- health loop      (GET /health; fast while the engine is down, so it rejoins within a second)
 +- metrics poller   (GET /metrics -> load, KV usage, block geometry)
 +- event sources    (from config or GET /kv_event_sources), handed to EventIngest to subscribe
"""

from __future__ import annotations

import json
import logging
import time

import trio

from events.discovery import EventSource, parse_kv_event_sources
from events.metrics_poller import EngineLoad as PolledLoad
from events.metrics_poller import poll_metrics
from gateway.engines import EngineState
from gateway.event_ingest import EventIngest
from gateway.upstream import UpstreamError

log = logging.getLogger("kvmesh.engines")
DOWN_POLL_S = 0.25
MODELS_REFRESH_S = 15.0


class Discovery:
    """What an engine says about itself; the planner is told once it is known."""

    def __init__(self, engine: EngineState) -> None:
        self.engine = engine

    async def models(self) -> set[str]:
        status, body = await self.engine.pool.get("/v1/models")
        if status != 200:
            raise UpstreamError(f"/v1/models answered {status}")
        data = json.loads(body).get("data", [])
        cards = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        lengths = [m.get("max_model_len") for m in cards]
        if lengths and all(type(n) is int and n > 0 for n in lengths):
            self.engine.max_model_len = max(lengths)
        return {m["id"] for m in cards}

    async def event_sources(self) -> list[EventSource]:
        config = self.engine.config
        if config.events:
            return [EventSource(config.events, config.replay, config.topic)]
        status, body = await self.engine.pool.get("/kv_event_sources")
        if status != 200:
            return []
        try:
            return parse_kv_event_sources(body, self.engine.url)
        except (ValueError, KeyError, TypeError):
            log.warning("unreadable /kv_event_sources", extra={"engine": self.engine.id})
            return []


async def _health_loop(engine: EngineState, planner, interval_s: float) -> None:
    while True:
        try:
            status, _ = await engine.pool.get("/health", timeout=min(2.0, interval_s * 2))
            detail = f"/health answered {status}"
        except UpstreamError as exc:
            status, detail = 0, str(exc)
        was_healthy = engine.healthy
        engine.health.record_health(status == 200, detail, time.monotonic())
        if engine.healthy != was_healthy:
            log.info("engine healthy" if engine.healthy else "engine unhealthy",
                     extra={"engine": engine.id, "reason": engine.health.reason(time.monotonic())})
            if engine.healthy and engine.health.was_down:
                planner.engine_recovered(engine.id)
        await trio.sleep(interval_s if engine.healthy else DOWN_POLL_S)


async def _discover(discovery: Discovery) -> tuple[set[str], list[EventSource]]:
    """Retry until the engine answers; an engine may start after the router."""
    while True:
        try:
            return await discovery.models(), await discovery.event_sources()
        except (UpstreamError, ValueError, KeyError, AttributeError):
            await trio.sleep(DOWN_POLL_S)


async def _refresh_models(discovery: Discovery) -> None:
    while True:
        await trio.sleep(MODELS_REFRESH_S)
        try:
            discovery.engine.models = await discovery.models() or discovery.engine.models
        except (UpstreamError, ValueError, KeyError, AttributeError):
            continue


async def watch_engine(engine: EngineState, planner, ingest: EventIngest, interval_s: float) -> None:
    """Own every task that keeps ``engine``'s state current; cancelled when the engine is removed."""
    discovery = Discovery(engine)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_health_loop, engine, planner, interval_s)
        models, sources = await _discover(discovery)
        if not planner.reads_events:
            sources = []  # `approximate` stands for routers that never see events: it knows what it sent
        engine.models = models or engine.models
        model = engine.config.model or (sorted(engine.models)[0] if engine.models else "")
        engine.event_sources = [s.endpoint for s in sources]
        planner.register_engine(engine, has_events=bool(sources))

        def on_load(load: PolledLoad, now: float) -> None:
            resized = load.block_size is not None and load.block_size != engine.load.block_size
            engine.load.running, engine.load.waiting = load.running, load.waiting
            engine.load.kv_usage, engine.load.polled_at = load.kv_cache_usage, now
            engine.load.num_blocks = load.num_gpu_blocks
            engine.load.block_size = load.block_size
            engine.load.poll_generation += 1
            engine.load.finished_since_poll = 0
            engine.load.reuse.record(load.prefix_cache_queries, load.prefix_cache_hits)
            if resized:
                planner.register_engine(engine, has_events=bool(sources))
            info = planner.cache.info(engine.id)
            if info is not None:
                info.freshness.on_poll(now, load.running)

        async def fetch(url: str) -> bytes:
            try:
                status, body = await engine.pool.get(url)
                if status != 200:
                    raise UpstreamError(f"{url} answered {status}")
            except UpstreamError as exc:
                engine.health.record_metrics(False, str(exc))
                raise
            engine.health.record_metrics(True)
            return body

        nursery.start_soon(_refresh_models, discovery)
        nursery.start_soon(lambda: poll_metrics(engine.id, "/metrics", fetch, on_load, interval_s=interval_s))
        if sources:
            ingest.add(engine.id, model, sources)
        log.info("engine discovered", extra={"engine": engine.id, "models": sorted(engine.models),
                                             "event_sources": engine.event_sources})
