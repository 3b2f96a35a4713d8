"""The router replica as an ASGI application: parse, route, proxy; plus its background tasks."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any

import trio

from autoscale.loop import AutoscaleLoop
from gateway import http_app, tracing
from gateway.admin import ADMIN_STATE_KEYS, handle_admin
from gateway.config import EngineConfig, RouterConfig
from gateway.engine_watch import watch_engine
from gateway.engines import EngineRegistry, EngineState
from gateway.event_ingest import EventIngest
from gateway.gatekeeper import Gatekeeper
from gateway.mesh_link import build_mesh_node, follow_mesh, registry_state, sweep_dispatches
from gateway.mesh_state import MeshState
from gateway.metrics import RouterMetrics
from gateway.openai_errors import ApiError
from gateway.proxy import Attempt, Exchange, Timeouts, forward
from gateway.request_body import Kind, debug_route_kind, parse_request
from gateway.route_planner import RoutePlanner

log = logging.getLogger("kvmesh.router")

INFERENCE_PATHS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
FORWARDED_HEADERS = ("content-type", "accept", "x-request-id", "traceparent", "connection")
"""Candidates for the engine; the proxy drops hop-by-hop ones, including those ``connection`` names."""


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.engines = EngineRegistry()
        for engine in config.engines:
            self.engines.add(engine)
        self.metrics = RouterMetrics()
        self.metrics.on_scrape(self._export_gauges)
        self.mesh = build_mesh_node(config)
        self.mesh_state = MeshState(self.mesh) if self.mesh is not None else None
        self.planner = RoutePlanner(config, self.engines, self.metrics)
        self.ingest = EventIngest(self.planner.cache, self.mesh)
        self.gate = Gatekeeper(config, self.metrics, self.mesh.member_id if self.mesh is not None else "local")
        self.timeouts = Timeouts(config.connect_timeout_s, config.first_byte_timeout_s, config.idle_timeout_s)
        self.active_requests = 0
        self.shutting_down = False
        self._nursery: trio.Nursery | None = None
        self._watches: dict[str, trio.CancelScope] = {}
        self._exported_engines: set[str] = set()
        self._exported_peers: set[str] = set()
        """Label values exported at the last scrape, so gauges of removed engines and gone peers are dropped."""

    async def run_background(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Mesh, tokenizers, event ingestion and engine watchers; owned by the process nursery."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.ingest.run)
            if self.mesh is not None and self.mesh_state is not None:
                await nursery.start(self.mesh.run)
                follow_mesh(self, self.mesh_state)
                nursery.start_soon(sweep_dispatches, self.mesh_state)
                if self.gate.has_limits:
                    nursery.start_soon(self.gate.share_limits, self.mesh_state)
            await nursery.start(self.planner.run)
            for engine in self.engines.all():
                self._watch(engine)
            if self.config.autoscaler.enabled:
                self.autoscaler = AutoscaleLoop(self)
                await nursery.start(self.autoscaler.run)
            task_status.started()

    def _watch(self, engine: EngineState) -> None:
        """Start the engine's watcher under its own cancel scope, so removing the engine stops it."""
        assert self._nursery is not None
        scope = trio.CancelScope()
        self._watches[engine.id] = scope

        async def watched() -> None:
            with scope:
                await watch_engine(engine, self.planner, self.ingest, self.config.metrics_interval_s)

        self._nursery.start_soon(watched)

    def add_engine(self, config: EngineConfig, replicate: bool = True) -> str:
        engine = self.engines.add(config)
        if engine.id not in self._watches:
            self._watch(engine)
        if replicate and self.mesh_state is not None:
            self.mesh_state.set_registry(engine.id, {**registry_state(engine), "url": engine.url})
        return engine.id

    def remove_engine(self, engine_id: str, replicate: bool = True) -> None:
        scope = self._watches.pop(engine_id, None)
        if scope is not None:
            scope.cancel()
        self.ingest.remove(engine_id)
        self.engines.remove(engine_id)
        self.planner.cache.unregister(engine_id)
        if replicate and self.mesh_state is not None:
            self.mesh_state.set_registry(engine_id, {"removed": True})

    def set_engine_state(self, engine_id: str, state: dict[str, Any], replicate: bool = True) -> None:
        engine = self.engines.get(engine_id)
        if engine is None:
            return
        for key, value in state.items():
            if key == "island":
                engine.config.island = value
            elif key in ADMIN_STATE_KEYS:
                setattr(engine, key, value)
        if replicate and self.mesh_state is not None:
            self.mesh_state.set_registry(engine_id, {**registry_state(engine), "url": engine.url})

    def _export_gauges(self, metrics: RouterMetrics) -> None:
        now, clock = time.monotonic(), trio.current_time()
        engines = self.engines.all()
        per_engine = (metrics.in_flight, metrics.engine_healthy, metrics.breaker_state, metrics.index_blocks,
                      metrics.confidence)
        _drop_labels(per_engine, self._exported_engines - {e.id for e in engines})
        self._exported_engines = {e.id for e in engines}
        for engine in engines:
            metrics.in_flight.labels(engine.id).set(engine.in_flight)
            metrics.engine_healthy.labels(engine.id).set(1 if engine.routable else 0)
            metrics.breaker_state.labels(engine.id).set(engine.health.breaker.state_code(now))
            metrics.index_blocks.labels(engine.id).set(self.planner.cache.store.block_count(engine.id))
            info = self.planner.cache.info(engine.id)
            metrics.confidence.labels(engine.id).set(info.freshness.confidence(clock) if info else 0.0)
        if self.mesh is not None and self.mesh.replication is not None:
            heard = self.mesh.replication.last_heard
            _drop_labels((metrics.peer_silence,), self._exported_peers - set(heard))
            self._exported_peers = set(heard)
            for peer, at in heard.items():
                metrics.peer_silence.labels(peer).set(clock - at)

    def mesh_report(self) -> dict[str, Any]:
        if self.mesh is None:
            return {"enabled": False, "members": []}
        return {"enabled": True, **self.mesh.describe(), "ingesting": self.ingest.ingesting(),
                "index_transfer": dict(self.ingest.stats)}

    def isolate(self, isolated: bool) -> None:
        if self.mesh is None:
            raise ApiError(409, "this router runs without a mesh", code="no_mesh")
        self.mesh.isolate(isolated)

    async def leave(self) -> None:
        if self.mesh is not None:
            with trio.move_on_after(2):
                await self.mesh.leave()

    async def __call__(self, scope: dict[str, Any], receive: http_app.Receive, send: http_app.Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        started = time.perf_counter()
        status = 500
        try:
            status = await self._dispatch(path, method, scope, receive, send)
        except ApiError as error:
            status = error.status
            if error.status != 499:
                await http_app.send_error(send, error)
        finally:
            endpoint = path if path in INFERENCE_PATHS or path.startswith(("/v1/", "/debug/")) else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    async def _dispatch(self, path: str, method: str, scope: dict, receive, send) -> int:
        if path in INFERENCE_PATHS:
            _require(method, "POST")
            return await self._inference(INFERENCE_PATHS[path], scope, receive, send)
        if path.startswith("/admin/"):
            self.gate.require_admin(dict(_headers(scope)))
            return await handle_admin(self, method, path, scope, receive, send)
        if path == "/debug/route":
            _require(method, "POST")
            headers = dict(_headers(scope))
            tenant = self.gate.tenant(headers)
            raw = await http_app.read_body(scope, receive, self.config.max_body_bytes)
            parsed = self.gate.isolate(tenant, parse_request(raw, debug_route_kind(raw)))
            plan = await self.planner.plan(parsed, headers)
            await http_app.send_json(send, 200, plan.explain())
            return 200
        _require(method, "GET")
        if path == "/v1/models":
            models = [{"id": m, "object": "model", "owned_by": "kvmesh", "created": 0} for m in self.engines.models()]
            await http_app.send_json(send, 200, {"object": "list", "data": models})
            return 200
        if path == "/health":
            await http_app.send_json(send, 200, {"status": "ok"})
            return 200
        if path == "/ready":
            ready = not self.shutting_down and any(e.routable for e in self.engines.all())
            await http_app.send_json(send, 200 if ready else 503, {"ready": ready})
            return 200 if ready else 503
        if path == "/metrics":
            content_type = [(b"content-type", b"text/plain; version=0.0.4")]
            await http_app.send_bytes(send, 200, self.metrics.render(), content_type)
            return 200
        raise ApiError(404, f"no route for {method} {path}", code="not_found")

    async def _inference(self, kind: Kind, scope: dict, receive, send) -> int:
        headers = dict(_headers(scope))
        with tracing.request_span(kind, headers) as span:
            try:
                status = await self._serve_inference(kind, scope, receive, send, headers, span)
            except ApiError as error:
                tracing.record_error(span, error.status, error.message)
                raise
            tracing.record_error(span, status, "upstream failed")
            return status

    async def _serve_inference(self, kind: Kind, scope: dict, receive, send, headers: dict[str, str], span) -> int:
        if self.shutting_down:
            raise ApiError(503, "router is shutting down", code="shutting_down")
        with tracing.step("parse"):
            tenant = self.gate.tenant(headers)
            raw = await http_app.read_body(scope, receive, self.config.max_body_bytes)
            parsed = self.gate.isolate(tenant, parse_request(raw, kind))
            priority = self.gate.priority(tenant, headers)
        tracing.name_request(span, kind, parsed.model, parsed.max_tokens, tenant.name)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex[:16]
        self.active_requests += 1
        try:
            self.gate.precheck(tenant, priority, self.engines.for_model(parsed.model))
            plan = await self.planner.plan(parsed, headers)
            span.set_attribute("gen_ai.usage.input_tokens", plan.prompt_tokens)
            self.gate.admit(tenant, priority, parsed, plan.prompt_tokens, plan.engines)
            self.planner.dispatched(plan)
            upstream_headers = [(k, v) for k, v in headers.items() if k in FORWARDED_HEADERS]
            upstream_headers.append(("x-request-id", request_id))

            def route_header(engine: EngineState, attempts: list[Attempt]) -> list[tuple[bytes, bytes]]:
                value = plan.header(engine.id, len(attempts))
                return [(b"x-kvmesh-route", value.encode()), (b"x-request-id", request_id.encode())]

            result = await _forward_until_disconnect(
                receive, send,
                lambda send_: forward(plan.engines, Exchange("POST", scope["path"], plan.body(), upstream_headers,
                                                             send_, self.timeouts, route_header, parsed.stream),
                                      self.config.max_attempts),
            )
            if result is None:
                log.info("client disconnected", extra={"request_id": request_id})
                return 499
            for attempt in result.attempts:
                if attempt.outcome != "ok":
                    self.metrics.upstream_errors.labels(attempt.engine, attempt.outcome.split(" ")[0]).inc()
            self.planner.observe(plan, result)
            log.info("routed", extra={"request_id": request_id, "tenant": tenant.name, "model": parsed.model,
                                      "engine": result.engine.id if result.engine else None,
                                      "attempts": len(result.attempts), "reason": plan.decision.reason,
                                      "ttft_ms": round((result.ttft_s or 0) * 1000, 2)})
            return result.status
        finally:
            self.active_requests -= 1


def _drop_labels(gauges, gone: set[str]) -> None:
    for gauge in gauges:
        for label in gone:
            with contextlib.suppress(KeyError):
                gauge.remove(label)


async def _forward_until_disconnect(receive: http_app.Receive, send: http_app.Send, proxying):
    """Run the proxy; if the client goes away before the response is complete, cancel it so the engine
    stops work too. (ASGI also reports a disconnect after a complete response: that one is ignored.)"""
    outcome: dict[str, Any] = {}
    finished = False

    async def tracking_send(message: dict[str, Any]) -> None:
        nonlocal finished
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            finished = True
        await send(message)

    async def watch(cancel_scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not finished:
                    cancel_scope.cancel()
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, nursery.cancel_scope)
        try:
            outcome["result"] = await proxying(tracking_send)
        except ApiError as error:
            outcome["error"] = error
        nursery.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def _headers(scope: dict) -> list[tuple[str, str]]:
    return [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", [])]


def _require(method: str, expected: str) -> None:
    if method != expected:
        raise ApiError(405, f"method {method} not allowed; use {expected}", code="method_not_allowed")


async def _lifespan(receive: http_app.Receive, send: http_app.Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
