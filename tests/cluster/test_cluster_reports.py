"""Pure parts of the demo and ``kvmesh bench mesh``: metric parsing, verdicts and tables."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from bench.cluster_run import ClusterRun, served_requests
from bench.demo import report
from bench.mesh import INGEST_OPS_PER_S, LAG_P99_MS, MeshRow, format_rows, verdicts
from bench.report import Row
from bench.stats import summarize

METRICS = """# HELP kvmesh_requests_total Requests answered
# TYPE kvmesh_requests_total counter
kvmesh_requests_total{endpoint="other",status="200"} 900.0
kvmesh_requests_total{endpoint="/v1/chat/completions",status="200"} 40.0
kvmesh_requests_total{endpoint="/v1/chat/completions",status="503"} 2.0
kvmesh_requests_total{endpoint="/v1/models",status="200"} 1.0
"""


def test_served_requests_counts_api_calls_not_health_checks() -> None:
    assert served_requests(METRICS) == 43.0
    assert served_requests("") == 0.0


def _row(replicas: int, workload: str, hit: float) -> MeshRow:
    return MeshRow(replicas, workload, 36, 0, hit, 50.0, 80.0, [0.2] * replicas)


LAG_OK = {"lag_p50_ms": 2.0, "lag_p99_ms": 9.0, "delivered_fraction": 1.0}
INGEST_OK = {"ops_per_s": 2 * INGEST_OPS_PER_S, "store_ops_per_s": 1e5, "batch": 32}


@given(st.floats(0, 1), st.floats(0, 1))
def test_hit_rate_verdict_is_the_drop_from_fewest_to_most_replicas(first: float, last: float) -> None:
    rows = [_row(8, "c", last), _row(1, "c", first), _row(4, "c", 0.0)]
    (verdict, *_rest) = verdicts(rows, {}, INGEST_OK)
    assert math.isclose(verdict.value, 100 * (first - last), abs_tol=1e-9)
    assert verdict.passed == (100 * (first - last) <= 1.0)


def test_lag_and_ingest_verdicts() -> None:
    slow = {**LAG_OK, "lag_p99_ms": LAG_P99_MS + 1}
    lost = {**LAG_OK, "delivered_fraction": 0.99}
    judged = verdicts([], {2: LAG_OK, 4: slow, 8: lost}, {**INGEST_OK, "ops_per_s": INGEST_OPS_PER_S - 1})
    assert [v.passed for v in judged] == [True, False, False, False]
    assert "8 replicas" in judged[2].target


def test_mesh_table_shows_every_configuration() -> None:
    text = format_rows([_row(1, "a", 0.9), _row(8, "a", 0.895)], {8: LAG_OK}, INGEST_OK)
    assert "90.0" in text and "89.5" in text and "20/20/20/20/20/20/20/20" in text
    assert "100,000 block ops/s" in text


def _run(label: str, workload: str, hit: float) -> ClusterRun:
    row = Row(label, workload, 4, summarize([], 1.0), hit)
    return ClusterRun(row, ["router-0", "router-1"], [30.0, 10.0], [1.0, 0.5], 2.0)


def test_demo_report_compares_policies_per_workload() -> None:
    text = report([_run("kv_aware", "a", 0.96), _run("round_robin", "a", 0.44)])
    assert "shared documents: engine prefix-cache hit rate 96.0% with kvmesh vs 44.0% round robin" in text
    assert "router-0 30 (75%)" in text and "router-1 10 (25%)" in text
    assert "multi-turn" not in text
