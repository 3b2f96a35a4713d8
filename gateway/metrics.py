"""The router's own Prometheus metrics, in a registry per router so tests can run several in one process."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from events import counters as event_counters
from gateway.metrics_page import page_parts, write_page

LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


ENGINE_COUNTERS = (event_counters.EVENTS_DROPPED, event_counters.EVENT_BATCHES, event_counters.BLOCK_OPS,
                   event_counters.REPLAYS, event_counters.METRICS_POLLS, event_counters.HEALTH_POLLS,
                   event_counters.SUBSCRIBER_RESTARTS, event_counters.INGEST_DEFERRED,
                   event_counters.ENGINE_TASK_FAILURES, event_counters.ENGINE_VALUES_REJECTED)
"""The process-wide counters with an ``engine`` label."""


class EngineAttempt(Protocol):
    engine: str
    outcome: str
    """"ok", or the failure with its cause first (``"status 503"``, ``"unreachable (...)"``)."""


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvmesh_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.internal_errors = Counter("kvmesh_internal_errors", "Requests that hit a router bug (answered 500)",
                                       ["endpoint"], registry=r)
        self.request_errors = Counter("kvmesh_request_errors", "Non-2xx answers by endpoint, status and reason "
                                      "(the error code)", ["endpoint", "status", "code"], registry=r)
        self.latency = Histogram("kvmesh_request_duration_seconds", "Whole request time", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvmesh_time_to_first_byte_seconds", "Time to the engine's first body chunk",
                              ["engine"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter("kvmesh_upstream_errors", "Failed attempts at an engine",
                                       ["engine", "cause"], registry=r)
        self.decisions = Counter("kvmesh_route_decisions", "Routing decisions", ["policy", "reason"], registry=r)
        self.decision_latency = Histogram("kvmesh_route_decision_seconds", "Tokenize + score time",
                                          buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                   0.1, 0.25), registry=r)
        self.predicted_cached = Counter("kvmesh_predicted_cached_tokens", "Prompt tokens the router expected "
                                        "the chosen engine to have cached", registry=r)
        self.reported_cached = Counter("kvmesh_reported_cached_tokens", "Cached prompt tokens reported by "
                                       "engines in usage.prompt_tokens_details", registry=r)
        self.in_flight = Gauge("kvmesh_engine_in_flight", "Requests outstanding per engine", ["engine"],
                               registry=r)
        self.engine_healthy = Gauge("kvmesh_engine_healthy", "1 when the engine takes traffic", ["engine"],
                                    registry=r)
        self.breaker_state = Gauge("kvmesh_engine_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open",
                                   ["engine"], registry=r)
        self.admission_rejections = Counter("kvmesh_admission_rejections", "Requests refused before routing",
                                            ["reason", "priority"], registry=r)
        self.index_blocks = Gauge("kvmesh_index_blocks", "Blocks the index says each engine holds", ["engine"],
                                  registry=r)
        self.confidence = Gauge("kvmesh_engine_confidence", "Trust in the index's view of each engine (0..1)",
                                ["engine"], registry=r)
        self.peer_silence = Gauge("kvmesh_mesh_peer_silence_seconds", "Time since each replica was last heard "
                                  "on the replication channel (the replication lag bound)", ["peer"], registry=r)
        self.continuations = Counter("kvmesh_stream_continuations", "Broken streams, by whether another engine "
                                     "continued them", ["outcome"], registry=r)
        self.continuation_latency = Histogram("kvmesh_continuation_latency_seconds", "From a stream's break to the "
                                              "next token the client got", buckets=LATENCY_BUCKETS, registry=r)
        self.loop_lag = Histogram("kvmesh_event_loop_lag_seconds", "How late the router's event loop woke a "
                                  "task that asked to run (what every request and health poll waited then)",
                                  buckets=LOOP_LAG_BUCKETS, registry=r)
        self.ingest_share = Gauge("kvmesh_ingest_share", "Share of the event loop KV-event ingest may take now "
                                  "(the idle share while no request is in flight; while serving, moved by the "
                                  "loop's lag)", registry=r)
        self.gc_pause = Histogram("kvmesh_gc_pause_seconds", "How long each cyclic garbage collection held the "
                                  "router process, by generation (2: a full walk of what it made since start-up)",
                                  ["generation"], buckets=LOOP_LAG_BUCKETS, registry=r)
        self.background_encode_failures = Counter("kvmesh_background_encode_failures",
                                                  "Deferred encodes of a prompt's fresh rest that failed after "
                                                  "the request went out (the next turn misses that rest)",
                                                  ["reason"], registry=r)
        self.engine_role = Gauge("kvmesh_engine_role", "1 for the role each engine plays: prefill, decode, both",
                                 ["engine", "role"], registry=r)
        self.pd_requests = Counter("kvmesh_pd_requests", "Requests of a disaggregated fleet: disaggregated, "
                                   "prefill_failed (served whole on decode) or skipped_<why>", ["outcome"],
                                   registry=r)
        self.pd_handoffs = Counter("kvmesh_pd_handoffs", "Decode legs of the handoff protocol by what their "
                                   "attempts carried: sent, missing_params, lease_expired, retried_without_params,"
                                   " unpaired_decode", ["outcome"], registry=r)
        self.pd_leg_failures = Counter("kvmesh_pd_leg_failures", "Failed prefill-leg attempts (the client never "
                                       "sees them)", ["leg", "cause"], registry=r)
        self._refresh: Callable[[RouterMetrics], None] = lambda metrics: None

    def forget_engine(self, engine_id: str) -> None:
        """Drop every series labelled with a removed engine, here and in the process-wide event counters:
        with an autoscaler adding and removing engines all day, series of engines long gone would otherwise
        grow the scrape (and this process) without bound."""
        per_engine = (self.ttft, self.upstream_errors, self.in_flight, self.engine_healthy, self.breaker_state,
                      self.index_blocks, self.confidence, self.engine_role)
        for metric in (*per_engine, *ENGINE_COUNTERS):
            metric.remove_by_labels({"engine": engine_id})

    def count_failed_attempts(self, attempts: Iterable[EngineAttempt]) -> list[str]:
        """Count each failed attempt against its engine by cause (the outcome's first word); the causes."""
        causes = []
        for attempt in attempts:
            if attempt.outcome != "ok":
                cause = attempt.outcome.split(" ")[0]
                self.upstream_errors.labels(attempt.engine, cause).inc()
                causes.append(cause)
        return causes

    def on_scrape(self, refresh: Callable[[RouterMetrics], None]) -> None:
        """Gauges of live state are set at scrape time rather than on every request."""
        self._refresh = refresh

    def _page(self) -> Iterator[bytes]:
        """This router's metrics, then the process-wide ones (event ingestion, mesh, process), in parts."""
        self._refresh(self)
        return page_parts((self.registry, REGISTRY))

    def render(self) -> bytes:
        return b"".join(self._page())

    async def render_yielding(self) -> bytes:
        """``render``, letting requests run while the page is written (``gateway.metrics_page``): a scrape in front
        of a large fleet no longer holds the loop for the whole page."""
        return await write_page(self._page())
