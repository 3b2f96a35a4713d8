"""Drive a running local cluster through HAProxy with a bench workload and collect what happened:
the engines' own hit rate and load, TTFT, errors, and how requests and CPU spread over the replicas."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import trio
from prometheus_client.parser import text_string_to_metric_families

from bench.client import TRANSPORT_ERRORS, HttpClient
from bench.report import Row
from bench.runner import MeasureOptions, measure
from bench.stats import shares
from cluster.cpu import session_cpu_seconds
from cluster.state import ClusterState

SERVED = "kvmesh_requests_total"
API_PREFIX = "/v1/"


def served_requests(metrics_text: str) -> float:
    """API requests a router answered (any status), from its /metrics; health checks are not counted."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == SERVED and sample.labels.get("endpoint", "").startswith(API_PREFIX):
                total += sample.value
    return total


async def _served(client: HttpClient, url: str) -> float:
    try:
        with trio.fail_after(5):
            response = await client.request(url + "/metrics")
        return served_requests(response.body.decode("utf-8", errors="replace"))
    except (*TRANSPORT_ERRORS, ValueError, trio.TooSlowError):
        return math.nan


@dataclass
class ClusterRun:
    """One workload against one cluster: the bench row plus the per-replica view."""

    row: Row
    replicas: list[str]
    replica_requests: list[float]
    replica_cpu_s: list[float]
    wall_s: float

    @property
    def replica_share(self) -> list[float]:
        return shares(dict(zip(self.replicas, self.replica_requests, strict=True)), self.replicas)


async def run_workload(
    state: ClusterState, label: str, options: MeasureOptions, concurrency: int
) -> ClusterRun:
    """Warm-up, optional priming and the measured run (bench.runner.measure) through HAProxy."""
    routers = state.by_role("router")
    engine_urls = [e.url or "" for e in state.by_role("engine")]
    client = HttpClient()
    try:
        before = [await _served(client, r.url or "") for r in routers]
        cpu_before = [session_cpu_seconds(r) for r in routers]
        started = time.monotonic()
        row = await measure(client, label, state.haproxy_url, engine_urls, concurrency, options)
        wall = time.monotonic() - started
        cpu_after = [session_cpu_seconds(r) for r in routers]
        after = [await _served(client, r.url or "") for r in routers]
    finally:
        await client.aclose()
    return ClusterRun(
        row=row,
        replicas=[r.name for r in routers],
        replica_requests=[a - b for a, b in zip(after, before, strict=True)],
        replica_cpu_s=[a - b for a, b in zip(cpu_after, cpu_before, strict=True)],
        wall_s=wall,
    )
