"""The router replica as an ASGI application: parse, admit, route, proxy."""

from __future__ import annotations

import contextlib
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from gateway import http_app, tracing
from gateway.admin import AdminApi, handle_admin
from gateway.asgi_server import HANGUP_EXTENSION
from gateway.config import RouterConfig
from gateway.continuation import ContinuationSpec
from gateway.disaggregation.flow import Disaggregation, PdRoute, explain
from gateway.engine_priority import with_engine_priority
from gateway.engines import EngineRegistry, EngineState
from gateway.fleet import Fleet
from gateway.gatekeeper import Gatekeeper
from gateway.metrics import RouterMetrics
from gateway.openai_errors import ApiError, error_type, sse_error_event
from gateway.proxy import (
    Attempt,
    Exchange,
    Forward,
    ProxyResult,
    Timeouts,
    UpstreamFailure,
    forward,
    report_continued,
)
from gateway.request_body import Kind, check_body_headers, parse_request
from gateway.route_planner import Plan, RoutePlanner
from mesh.node import MeshNode
from tokenization.worker import REQUESTER

log = logging.getLogger("kvmesh.router")

INFERENCE_PATHS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
ROUTE_LABELS = frozenset({*INFERENCE_PATHS, "/v1/models", "/debug/route"})
HEAD_PATHS = frozenset({"/health", "/ready", "/metrics"})
FORWARDED_HEADERS = ("content-type", "accept", "traceparent", "connection")
"""Client headers passed on to the engine (the proxy drops hop-by-hop ones, including those ``connection``
names); ``x-request-id`` is sent once, as the router's request id."""
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]{1,128}")
_HEADER_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e\t]{0,4094}[\x21-\x7e])?")
"""What h11 can send: visible ASCII with inner spaces. Client headers are decoded as latin-1 and may hold
anything else, which would fail the upstream request."""


class Router:
    """The replica's ASGI application: parse, admit, route, proxy. Its parts are built and their tasks run by
    ``gateway/replica.py``; ``forward`` is the proxy (a seam: tests answer in-process)."""

    def __init__(self, config: RouterConfig, *, engines: EngineRegistry, metrics: RouterMetrics,
                 planner: RoutePlanner, fleet: Fleet, gate: Gatekeeper, mesh: MeshNode | None, admin: AdminApi,
                 forward: Forward = forward) -> None:
        self.config = config
        self.engines = engines
        self.metrics = metrics
        self.metrics.on_scrape(self._export_gauges)
        self.planner = planner
        self.fleet = fleet
        self.gate = gate
        self.mesh = mesh
        self.admin = admin
        self.forward = forward
        self.disaggregation = Disaggregation(config.pd, metrics, self.planner.prefill_leg_s,
                                             self.planner.observe_prefill)
        self.timeouts = Timeouts(config.connect_timeout_s, config.first_byte_timeout_s, config.idle_timeout_s)
        self.active_requests = 0
        self.shutting_down = False
        self._cuttable: set[trio.CancelScope] = set()
        """The proxying of every request in flight, so that a shutdown can end what outlived its grace."""
        self._exported_engines: set[str] = set()
        self._exported_peers: set[str] = set()
        """Label values exported at the last scrape, so gauges of removed engines and gone peers are dropped."""

    def _export_gauges(self, metrics: RouterMetrics) -> None:
        now = trio.current_time()
        engines = self.engines.all()
        per_engine = (metrics.in_flight, metrics.engine_healthy, metrics.breaker_state, metrics.index_blocks,
                      metrics.confidence)
        _drop_labels(per_engine, self._exported_engines - {e.id for e in engines})
        self._exported_engines = {e.id for e in engines}
        metrics.engine_role.clear()
        for engine in engines:
            metrics.engine_role.labels(engine.id, engine.role).set(1)
            metrics.in_flight.labels(engine.id).set(engine.in_flight)
            metrics.engine_healthy.labels(engine.id).set(1 if engine.routable else 0)
            metrics.breaker_state.labels(engine.id).set(engine.health.breaker.state_code(now))
            metrics.index_blocks.labels(engine.id).set(self.planner.cache.block_count(engine.id))
            info = self.planner.cache.info(engine.id)
            metrics.confidence.labels(engine.id).set(info.freshness.confidence(now) if info else 0.0)
        if self.mesh is not None and self.mesh.replication is not None:
            heard = self.mesh.replication.last_heard
            _drop_labels((metrics.peer_silence,), self._exported_peers - set(heard))
            self._exported_peers = set(heard)
            for peer, at in heard.items():
                metrics.peer_silence.labels(peer).set(now - at)

    def cut_requests(self) -> int:
        """The shutdown grace is over: end every request still proxying (a stream gets an SSE error event,
        anything else a 503); returns how many were cut."""
        for scope in self._cuttable:
            scope.cancel()
        return len(self._cuttable)

    async def __call__(self, scope: dict[str, Any], receive: http_app.Receive, send: http_app.Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        started = trio.current_time()
        response = _Response(send)
        record = RequestRecord(request_id_of(dict(_headers(scope))))
        status = 500
        try:
            status = await self._dispatch(path, method, scope, receive, response, record)
        except ApiError as error:
            status = error.status
            record.refused(error)
            if error.code == "body_too_large" or (error.status == 429 and not record.body_read):
                await response.fail_then_drain(error, receive, 2 * self.config.max_body_bytes)
            elif error.status != 499:
                await response.fail(error)
        except Exception:
            # The last resort: a bug must cost one request a 500 in OpenAI's shape, never the connection.
            status = 500
            self.metrics.internal_errors.labels(endpoint_label(path)).inc()
            record.code = "internal_error"
            log.exception("internal error", extra=record.log_fields(method, path, status))
            await response.fail(ApiError(500, "internal error in the router", code="internal_error"))
        finally:
            endpoint = endpoint_label(path)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(trio.current_time() - started)
            if status >= 400:
                self.metrics.request_errors.labels(endpoint, str(status), record.reason(status)).inc()
                if record.code != "internal_error":
                    log.warning("request failed", extra=record.log_fields(method, path, status))

    async def _dispatch(self, path: str, method: str, scope: dict, receive, response: _Response,
                        record: RequestRecord) -> int:
        if path in INFERENCE_PATHS:
            _require(method, "POST")
            return await self._inference(INFERENCE_PATHS[path], scope, receive, response, record)
        send = response.send
        if path.startswith("/admin/"):
            self.gate.require_admin(dict(_headers(scope)))
            return await handle_admin(self.admin, method, path, scope, receive, send)
        if path == "/debug/route":
            _require(method, "POST")
            headers = dict(_headers(scope))
            # It shows what the engines hold for every tenant's prompts: admins only.
            tenant = self.gate.admin_tenant(headers)
            record.tenant = tenant.name
            REQUESTER.set(tenant.name)
            self.gate.admit_debug_route(tenant, _client_host(scope))
            parsed = self.gate.isolate(tenant, await self._read_request(None, scope, receive, headers))
            record.body_read = True
            # Scoring tokenizes like a request: it is admitted and charged like one.
            priority = self.gate.priority(tenant, headers)
            self.gate.precheck(tenant, priority, self.engines.for_model(parsed.model))
            plan = await self.planner.plan(parsed, headers)
            self.gate.admit(tenant, priority, parsed, plan.charged_tokens, plan.engines)
            await http_app.send_json(send, 200, {**plan.explain(), "pd": explain(self._pd_route(plan, dry_run=True))})
            return 200
        if method == "HEAD" and path in HEAD_PATHS:
            method, send = "GET", _without_body(send)
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
            await http_app.send_bytes(send, 200, await self.metrics.render_yielding(), content_type)
            return 200
        raise ApiError(404, f"no route for {method} {path[:200]}", code="not_found")

    async def _inference(self, kind: Kind, scope: dict, receive, response: _Response, record: RequestRecord) -> int:
        headers = dict(_headers(scope))
        with tracing.request_span(kind, headers) as span:
            try:
                status = await self._serve_inference(kind, scope, receive, response, headers, span, record)
            except ApiError as error:
                tracing.record_error(span, error.status, error.message)
                raise
            tracing.record_error(span, status, "upstream failed")
            return status

    async def _read_request(self, kind: Kind | None, scope: dict, receive, headers: dict[str, str]):
        check_body_headers(headers)
        raw = await http_app.read_body(scope, receive, self.config.max_body_bytes, self.config.limits.body_timeout_s)
        return parse_request(raw, kind, self.config.limits)

    async def _serve_inference(self, kind: Kind, scope: dict, receive, response: _Response,
                               headers: dict[str, str], span, record: RequestRecord) -> int:
        if self.shutting_down:
            raise ApiError(503, "router is shutting down", code="shutting_down")
        with tracing.step("parse"):
            tenant = self.gate.tenant(headers)
            record.tenant = tenant.name
            REQUESTER.set(tenant.name)  # long prompts queue for the tokenizer workers per tenant
            priority = self.gate.priority(tenant, headers)
            self.gate.check_rate(tenant, priority)
            parsed = self.gate.isolate(tenant, await self._read_request(kind, scope, receive, headers))
            parsed = with_engine_priority(self.config.engine_priority, priority, parsed)
            record.body_read = True
        tracing.name_request(span, kind, parsed.model, parsed.max_tokens, tenant.name)
        request_id = record.request_id
        self.active_requests += 1
        plan: Plan | None = None
        try:
            self.gate.precheck(tenant, priority, self.engines.for_model(parsed.model))
            plan = await self.planner.plan(parsed, headers)
            span.set_attribute("gen_ai.usage.input_tokens", plan.prompt_tokens)
            self.gate.admit(tenant, priority, parsed, plan.charged_tokens, plan.engines)
            pd = self._pd_route(plan)
            if pd is not None:
                plan.engines = pd.decode  # the request is served there; prefill-only engines never decode
                self.planner.dispatched_prefill(plan, pd.prefill[:1])
            self.planner.dispatched(plan)
            upstream_headers = [*forwarded_headers(headers), ("x-request-id", request_id)]
            detailed = self.gate.sees_cache_state(headers)

            def route_header(engine: EngineState, attempts: list[Attempt]) -> list[tuple[bytes, bytes]]:
                value = plan.header(engine.id, len(attempts), detailed)
                return [(b"x-kvmesh-route", value.encode()), (b"x-request-id", request_id.encode())]

            continuation = ContinuationSpec.of(plan.parsed.body, kind, parsed.stream, plan.counted_tokens)
            cut = trio.CancelScope()
            self._cuttable.add(cut)
            try:
                with cut:
                    result = await _forward_until_disconnect(
                        scope, receive, response, lambda: self.planner.encode_rest(plan),
                        lambda send_: self._proxy(plan, pd, Exchange("POST", scope["path"], plan.parsed.raw,
                                                                     upstream_headers, send_, self.timeouts,
                                                                     route_header, parsed.stream, continuation),
                                                  detailed),
                    )
                if cut.cancelled_caught:
                    raise ApiError(503, "the router shut down before the answer was complete; retry the request",
                                   code="shutting_down")
            except UpstreamFailure as error:
                record.attempts = _attempt_records(error.attempts)
                self.metrics.count_failed_attempts(error.attempts)
                raise _without_engine_details(error, record) from None
            except ApiError as error:
                raise _without_engine_details(error, record) from None
            finally:
                self._cuttable.discard(cut)
                self.planner.encode_rest(plan)
            if result is None:
                record.code = "client_disconnected"
                return 499
            record.attempts = _attempt_records(result.attempts)
            self.metrics.count_failed_attempts(result.attempts)
            self.planner.observe(plan, result, prefilled=pd is not None and bool(pd.prefill))
            if result.continuations:
                final = plan.header(result.continuations[-1].to_engine or "", len(result.attempts))
                report_continued(self.metrics, request_id, result.continuations, final)
            if result.status >= 400:
                record.code = "engine_error"
                return result.status
            log.info("routed", extra={"request_id": request_id, "tenant": tenant.name, "model": parsed.model,
                                      "engine": result.engine.id if result.engine else None,
                                      "attempts": len(result.attempts), "reason": plan.decision.reason,
                                      "ttft_ms": round((result.ttft_s or 0) * 1000, 2)})
            return result.status
        finally:
            self.active_requests -= 1
            if plan is not None:
                self.planner.finished(plan)

    def _pd_route(self, plan: Plan, dry_run: bool = False) -> PdRoute | None:
        """The request's prefill/decode route in a disaggregated fleet; None otherwise."""
        return self.disaggregation.route(self.engines.for_model(plan.parsed.model), plan.engines, plan.decision,
                                         plan.counted_tokens, plan.parsed.body, dry_run,
                                         lambda engine: self.planner.cache.held_by_source(engine, plan.chains))

    async def _proxy(self, plan: Plan, pd: PdRoute | None, exchange: Exchange, detailed: bool) -> ProxyResult:
        if pd is None:
            return await self.forward(plan.engines, exchange, self.config.max_attempts)
        return await self.disaggregation.serve(pd, plan.parsed.body, plan.parsed.raw, exchange, self.forward,
                                               self.config.max_attempts, detailed)


def _attempt_records(attempts: list[Attempt]) -> list[dict[str, Any]]:
    return [{"engine": a.engine, "outcome": a.outcome, "status": a.status} for a in attempts]


def _drop_labels(gauges, gone: set[str]) -> None:
    for gauge in gauges:
        for label in gone:
            with contextlib.suppress(KeyError):
                gauge.remove(label)


@dataclass
class RequestRecord:
    """What the one log line of a failed request says: who asked, why it failed, what each engine did."""

    request_id: str
    tenant: str | None = None
    code: str | None = None
    detail: str | None = None
    """Log-only detail (engine addresses, errno text) kept out of the client's answer."""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    body_read: bool = False
    """Whether the request body was read: a 429 before that drains it after answering, as a 413 does."""

    def refused(self, error: ApiError) -> None:
        self.code = self.code or error.code or error_type(error.status)
        self.detail = self.detail or error.message

    def reason(self, status: int) -> str:
        """A bounded metric label: the error code (a literal in the code base) or the status class."""
        return self.code or error_type(status)

    def log_fields(self, method: str, path: str, status: int) -> dict[str, Any]:
        return {"request_id": self.request_id, "tenant": self.tenant, "method": method, "path": path[:200],
                "status": status, "code": self.reason(status), "detail": self.detail, "attempts": self.attempts}


def _without_engine_details(error: ApiError, record: RequestRecord) -> ApiError:
    """The proxy's "no engine could serve" names every engine and its errno text: that goes to the log;
    the client gets the status, the code and its request id."""
    if error.code != "no_engine_available":
        return error
    record.code, record.detail = error.code, error.message
    return ApiError(error.status, f"no engine could serve the request (request id {record.request_id})",
                    code=error.code, retry_after=error.retry_after)


def _without_body(send: http_app.Send) -> http_app.Send:
    """A HEAD answer: the GET's head (its content-length included) and no body bytes."""

    async def head_only(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return head_only


class _Response:
    """ASGI ``send`` that remembers how far the response got, so an error never sends a second head."""

    def __init__(self, send: http_app.Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.event_stream = False
        self.on_start: Callable[[], None] = _nothing
        """Called as the head goes out (set while the proxy answers: see ``_forward_until_disconnect``)."""

    async def send(self, message: dict[str, Any]) -> None:
        """Every relayed chunk passes here: one wrapper for all the router tracks of its answer."""
        kind = message["type"]
        if kind == "http.response.body":
            if not message.get("more_body", False):
                self.finished = True
        elif kind == "http.response.start":
            self.on_start()
            self.started = True
            self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", ()))
        await self._send(message)

    async def fail(self, error: ApiError) -> None:
        """Answer ``error``; after the head went out, end the body (an event stream with an SSE error event,
        which OpenAI clients raise). A client already gone is ignored."""
        try:
            if not self.started:
                await http_app.send_error(self.send, error)
            elif not self.finished:
                tail = sse_error_event(error.message, error.status) if self.event_stream else b""
                await self.send({"type": "http.response.body", "body": tail, "more_body": False})
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def fail_then_drain(self, error: ApiError, receive: http_app.Receive, budget: int) -> None:
        """A refused body: the whole answer goes out at once (its content-length tells the client it is
        complete), but the exchange ends only once the rest of the body is read. The server closes a
        connection whose request is unfinished when the response ends, and a client still writing then
        sees a reset instead of the answer."""
        if self.started:
            await self.fail(error)
            return
        body = error.body()
        try:
            await self.send({"type": "http.response.start", "status": error.status,
                             "headers": [*error.headers(), (b"content-length", str(len(body)).encode())]})
            await self.send({"type": "http.response.body", "body": body, "more_body": True})
            await http_app.drain_body(receive, budget)
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def endpoint_label(path: str) -> str:
    """The metric label of a path: a known route, else "other" (raw paths would grow /metrics without bound)."""
    return path if path in ROUTE_LABELS else "other"


def request_id_of(headers: dict[str, str]) -> str:
    """The client's ``x-request-id`` when it is a plain token, else a fresh one (it is echoed and logged).
    Fresh ids need uniqueness, not secrecy: ``os.urandom`` behind ``uuid4`` cost 20-50 us a request here."""
    value = headers.get("x-request-id", "")
    return value if _VISIBLE_ASCII.fullmatch(value) else f"{random.getrandbits(64):016x}"


def forwarded_headers(headers: dict[str, str]) -> list[tuple[str, str]]:
    """The client headers the engine gets; values h11 cannot send are dropped."""
    return [(k, v) for k, v in headers.items() if k in FORWARDED_HEADERS and _HEADER_VALUE.fullmatch(v)]


async def _forward_until_disconnect(scope: dict, receive: http_app.Receive, response: _Response,
                                    answering: Callable[[], None], proxying):
    """Run the proxy; if the client goes away before the response is complete, cancel it so the engine
    stops work too (a disconnect after a complete response is ignored). ``answering`` is called when the
    response head goes out. The router's own server reports the client's going through its hangup watch
    (``HANGUP_EXTENSION``: no task per request); under another ASGI server a task waits on ``receive``."""
    outcome: dict[str, Any] = {}

    def hung_up(cancel_scope: trio.CancelScope) -> None:
        if not response.finished:
            cancel_scope.cancel()

    async def watch(cancel_scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        hung_up(cancel_scope)

    async def answer() -> None:
        try:
            outcome["result"] = await proxying(response.send)
        except ApiError as error:
            outcome["error"] = error

    on_hangup = scope.get("extensions", {}).get(HANGUP_EXTENSION)
    response.on_start = answering
    try:
        if on_hangup is not None:
            with trio.CancelScope() as cancel, on_hangup(lambda: hung_up(cancel)):
                await answer()
        else:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, nursery.cancel_scope)
                await answer()
                nursery.cancel_scope.cancel()
    finally:
        response.on_start = _nothing
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def _nothing() -> None:
    return None


def _headers(scope: dict) -> list[tuple[str, str]]:
    return [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", [])]


def _client_host(scope: dict) -> str:
    """The peer's address as the server saw it (a proxy in front makes all its clients one)."""
    client = scope.get("client")
    return str(client[0]) if client else "-"


def _require(method: str, expected: str) -> None:
    if method != expected:
        raise ApiError(405, f"method {method} not allowed; use {expected}", code="method_not_allowed")
