"""The router's own Prometheus metrics, in a registry per router so tests can run several in one process."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvmesh_requests", "Requests answered", ["endpoint", "status"], registry=r)
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
        self._engines: Callable[[], list] = list

    def track_engines(self, engines: Callable[[], list]) -> None:
        """Export per-engine gauges from live state at scrape time rather than on every request."""
        self._engines = engines

    def render(self) -> bytes:
        for engine in self._engines():
            self.in_flight.labels(engine.id).set(engine.in_flight)
            self.engine_healthy.labels(engine.id).set(1 if engine.routable else 0)
            self.breaker_state.labels(engine.id).set(engine.health.breaker.state_code(time.monotonic()))
        return generate_latest(self.registry)
