"""Per-engine background tasks: discover models and event endpoints, poll health and /metrics, subscribe.

watch_engine(engine)              supervised: a bug anywhere below is logged, counted and restarted
 +- health loop      (GET /health; fast while the engine is down, so it rejoins within a second; a tick its
 |                    events and /metrics already answered, or a quiet one, may skip it: gateway/health_ticks.py)
 +- discovery        (GET /v1/models and /kv_event_sources, until the engine answers)
 +- models refresh   (GET /v1/models every MODELS_REFRESH_S)
 +- metrics poller   (GET /metrics -> load, KV usage, block geometry; quiet engines every few ticks)
 +- event sources    (from config or GET /kv_event_sources), handed to EventIngest to subscribe
 +- connector        (GET /server_info once: the P/D role and protocol, where vLLM's dev mode serves it)

Each task runs under :func:`gateway.engine_faults.supervise`: whatever an engine answers, the worst
outcome is that this engine is out of rotation while its task backs off; other engines and the
process never notice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Hashable

import trio

from events.counters import HEALTH_POLLS
from events.discovery import EventSource, parse_kv_event_sources, parse_models
from events.metrics_poller import EngineLoad as PolledLoad
from events.metrics_poller import poll_metrics
from events.poll_phase import phase_s, sleep_until_phase
from events.quiet_polls import QuietPolls, quiet_ticks
from gateway.adapters import base_model
from gateway.disaggregation.roles import SERVER_INFO_PATH, parse_server_info
from gateway.engine_faults import EngineFaults, supervise
from gateway.engines import EngineState
from gateway.event_ingest import EventIngest
from gateway.health_ticks import HealthTicks
from gateway.upstream import UpstreamError

log = logging.getLogger("kvmesh.engines")
DOWN_POLL_S = 0.25
MODELS_REFRESH_S = 15.0
SERVER_INFO_TIMEOUT_S = 10.0
SERVER_INFO_TRIES = 3
"""vLLM builds /server_info's system_env (pip, GPU tools) on its first call: seconds, then cached."""


class Discovery:
    """What an engine says about itself; the planner is told once it is known."""

    def __init__(self, engine: EngineState) -> None:
        self.engine = engine

    async def models(self) -> set[str]:
        """Raises UpstreamError while the engine cannot answer, ValueError if its answer is malformed."""
        status, body = await self.engine.pool.get("/v1/models")
        if status != 200:
            raise UpstreamError(f"/v1/models answered {status}")
        listed = parse_models(body)
        if listed.max_model_len is not None:
            self.engine.max_model_len = listed.max_model_len
        self.engine.adapters = listed.adapters
        return listed.ids

    async def connector(self) -> None:
        """The engine's P/D role and protocol from ``/server_info``, when it serves one (vLLM does in its
        development mode only: others answer 404 and keep the configured role). A malformed answer raises
        ValueError: counted, and the role stays unknown; the config's role and protocol always win."""
        for _ in range(SERVER_INFO_TRIES):
            try:
                status, body = await self.engine.pool.get(SERVER_INFO_PATH, timeout=SERVER_INFO_TIMEOUT_S)
            except UpstreamError:
                continue
            if status != 200:
                return
            role, protocol = parse_server_info(body)
            self.engine.reported_role, self.engine.reported_protocol = role, protocol
            log.info("engine reports its connector", extra={"engine": self.engine.id, "role": role,
                                                            "protocol": protocol})
            return

    async def event_sources(self) -> list[EventSource]:
        """Raises ValueError if the configured or announced endpoints are unusable."""
        config = self.engine.config
        if config.events:
            return [EventSource(config.events, config.replay, config.topic, curve_server_key=config.curve_server_key)]
        status, body = await self.engine.pool.get("/kv_event_sources")
        if status != 200:
            return []
        sources = parse_kv_event_sources(body, self.engine.url)
        if config.curve_server_key is None:
            return sources
        return [dataclasses.replace(source, curve_server_key=config.curve_server_key) for source in sources]


async def _health_loop(engine: EngineState, planner, faults: EngineFaults, interval_s: float,
                       skip: Callable[[], str | None]) -> None:
    """Poll /health at the engine's phase of each interval unless ``skip`` names why this tick need not
    (``gateway.health_ticks``); every 0.25 s while the engine is down."""
    phase = phase_s(engine.id, interval_s, 0.5)  # half an interval from the engine's metrics polls
    while True:
        reason = skip()
        if reason is not None:
            HEALTH_POLLS.labels(engine=engine.id, outcome=reason).inc()
            await sleep_until_phase(interval_s, phase)
            continue
        try:
            status, _ = await engine.pool.get("/health", timeout=min(2.0, interval_s * 2))
            detail = f"/health answered {status}"
        except UpstreamError as exc:
            status, detail = 0, str(exc)
        HEALTH_POLLS.labels(engine=engine.id, outcome="ok" if status == 200 else "failed").inc()
        was_healthy = engine.healthy
        engine.health.record_health(status == 200, detail, trio.current_time())
        faults.succeeded("health")
        if engine.healthy != was_healthy:
            log.info("engine healthy" if engine.healthy else "engine unhealthy",
                     extra={"engine": engine.id, "reason": engine.health.reason(trio.current_time())})
            if engine.healthy and engine.health.was_down:
                planner.engine_recovered(engine.id)
        if engine.healthy:
            await sleep_until_phase(interval_s, phase)
        else:
            await trio.sleep(DOWN_POLL_S)


async def _keep_warm(engine: EngineState) -> None:
    """Keep a young request connection to the engine between its requests (``EnginePool.keep_warm``); an engine
    that refuses is the health loop's to report."""
    while True:
        due = trio.current_time() + DOWN_POLL_S
        if engine.healthy and not engine.draining:
            with contextlib.suppress(UpstreamError):
                due = await engine.pool.keep_warm(in_use=engine.in_flight > 0)
        await trio.sleep_until(due)


async def _discover(discovery: Discovery) -> tuple[set[str], list[EventSource]]:
    """Retry until the engine answers; an engine may start after the router. A malformed answer raises
    (ValueError) so the supervisor counts it and backs off."""
    while True:
        try:
            return await discovery.models(), await discovery.event_sources()
        except UpstreamError:
            await trio.sleep(DOWN_POLL_S)


async def _refresh_models(discovery: Discovery, faults: EngineFaults) -> None:
    phase = phase_s(discovery.engine.id, MODELS_REFRESH_S)
    while True:
        if not faults.failing.get("models"):  # in a failure episode the supervisor has just backed off
            await sleep_until_phase(MODELS_REFRESH_S, phase)
        try:
            discovery.engine.models = await discovery.models() or discovery.engine.models
        except UpstreamError:
            continue  # the health loop reports an engine that does not answer
        faults.succeeded("models")


async def watch_engine(engine: EngineState, planner, ingest: EventIngest, interval_s: float) -> None:
    """Own every task that keeps ``engine``'s state current; cancelled when the engine is removed.

    Never raises (but Cancelled): a failure of the whole watcher, even a bug, restarts it after a backoff.
    """
    faults = EngineFaults(engine.id, engine.health)
    await supervise(faults, "watch", lambda: _watch(engine, planner, ingest, interval_s, faults))


async def _watch(engine: EngineState, planner, ingest: EventIngest, interval_s: float, faults: EngineFaults) -> None:
    discovery = Discovery(engine)
    sources: list[EventSource] | None = None  # the engine's event sources once discovered; until then health polls

    def event_mark() -> Hashable:
        info = planner.cache.info(engine.id)
        return (info.freshness.last_event_at, info.freshness.last_seq) if info is not None else None

    def ingest_behind() -> bool:
        info = planner.cache.info(engine.id)
        return info is None or info.freshness.behind_since is not None

    def active() -> bool:
        """Someone has requests on the engine, or the router cannot see whether anyone has."""
        return (not sources or engine.in_flight > 0 or not engine.healthy or engine.draining
                or engine.rejoining or planner.peer_in_flight().get(engine.id, 0) > 0)

    ticks = HealthTicks(quiet_ticks(interval_s))
    last_tick = -math.inf

    def health_skip() -> str | None:
        nonlocal last_tick
        polled_at = engine.load.polled_at
        answered, last_tick = polled_at is not None and polled_at > last_tick, trio.current_time()
        if not sources:  # not discovered yet, or no events to vouch for it: every tick polls
            return None
        routable = engine.routable and engine.health.health_failures == 0
        return ticks.skip(routable=routable, active=active(), mark=event_mark(),
                          answered=answered and not ingest_behind())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervise, faults, "health",
                           lambda: _health_loop(engine, planner, faults, interval_s, health_skip))
        found: dict[str, tuple[set[str], list[EventSource]]] = {}

        async def discover() -> None:
            found["result"] = await _discover(discovery)

        await supervise(faults, "discovery", discover)
        faults.succeeded("discovery")
        models, discovered = found["result"]
        # `approximate` stands for routers that never see events: it knows what it sent
        sources = discovered if planner.reads_events else []
        engine.models = models or engine.models
        model = engine.config.model or base_model(engine)
        engine.event_sources = [s.endpoint for s in sources]
        engine.dp_ranks = tuple(s.rank for s in sources)
        planner.register_engine(engine, has_events=bool(sources))

        cadence = QuietPolls(quiet_ticks(interval_s))

        def poll_due() -> bool:
            return cadence.due(active(), event_mark())

        def on_load(load: PolledLoad, now: float) -> None:
            cadence.polled(load.running + load.waiting > 0)
            resized = ((load.block_size is not None and load.block_size != engine.load.block_size)
                       or load.num_gpu_blocks != engine.load.num_blocks)
            engine.load.running, engine.load.waiting = load.running, load.waiting
            engine.load.kv_usage, engine.load.polled_at = load.kv_cache_usage, now
            engine.load.num_blocks = load.num_gpu_blocks
            engine.load.block_size = load.block_size
            engine.load.max_lora, engine.load.running_adapters = load.max_lora, load.running_adapters
            engine.load.poll_generation += 1
            engine.load.finished_since_poll = 0
            engine.load.reuse.record(load.prefix_cache_queries, load.prefix_cache_hits)
            if resized:
                planner.register_engine(engine, has_events=bool(sources))
            info = planner.cache.info(engine.id)
            if info is not None:
                info.freshness.on_poll(now, load.running)
            faults.succeeded("metrics")

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

        nursery.start_soon(supervise, faults, "models", lambda: _refresh_models(discovery, faults))
        nursery.start_soon(supervise, faults, "warm", lambda: _keep_warm(engine))
        nursery.start_soon(supervise, faults, "server_info", discovery.connector)
        nursery.start_soon(supervise, faults, "metrics",
                           lambda: poll_metrics(engine.id, "/metrics", fetch, on_load, interval_s=interval_s,
                                                due=poll_due))
        if sources:
            ingest.add(engine.id, model, sources, engine.first_tokens.let_first_tokens_pass,
                       lambda: engine.load.num_blocks)
        faults.succeeded("watch")
        log.info("engine discovered", extra={"engine": engine.id, "models": sorted(engine.models),
                                             "event_sources": engine.event_sources})
