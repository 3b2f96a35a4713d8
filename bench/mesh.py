"""``kvmesh bench mesh``: does the fleet keep its hit rate as router replicas are added?

For 1, 2, 4 and 8 replicas behind a real HAProxy (TCP, round robin), each on a fresh local cluster:
the engines' prefix-cache hit rate and TTFT on the multi-turn (c) and shared-document (a) workloads,
and each replica's CPU. Then the replication itself (bench/mesh_measure.py, in this process over
loopback TCP): replication lag from a write on one replica to its visibility on all others, and
the block-op ingest rate of one replica.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import trio

from bench import mesh_measure as measure
from bench.cluster_run import ClusterRun, run_workload
from bench.report import Verdict
from bench.runner import MeasureOptions
from cluster.daemon import StartError
from cluster.local import ClusterError, UpOptions, down, up
from cluster.state import load

WORKLOADS = ("c", "a")
HIT_RATE_POINTS = 1.0
LAG_P99_MS = 100.0
INGEST_OPS_PER_S = 50_000.0


@dataclass
class MeshRow:
    replicas: int
    workload: str
    requests: int
    errors: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    cpu_per_replica: list[float]
    """Fraction of one core each replica used during the measured run."""

    @classmethod
    def of(cls, replicas: int, run: ClusterRun) -> MeshRow:
        s = run.row.summary
        cores = [cpu / run.wall_s if run.wall_s > 0 else math.nan for cpu in run.replica_cpu_s]
        return cls(
            replicas,
            run.row.workload,
            s.requests,
            s.errors,
            run.row.hit_rate,
            1000 * s.ttft_p50,
            1000 * s.ttft_p95,
            cores,
        )


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def format_rows(rows: list[MeshRow], lags: dict[int, dict[str, float]], ingest: dict[str, float]) -> str:
    head = (
        f"{'replicas':>8} {'workload':>8} {'reqs':>5} {'errs':>4} {'hit %':>6} {'ttft p50':>8} "
        f"{'ttft p95':>8}  {'cpu per replica (% of a core)'}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cpu = "/".join(f"{100 * c:.0f}" for c in r.cpu_per_replica)
        lines.append(
            f"{r.replicas:>8} {r.workload:>8} {r.requests:>5} {r.errors:>4} {_num(100 * r.hit_rate):>6} "
            f"{_num(r.ttft_p50_ms):>8} {_num(r.ttft_p95_ms):>8}  {cpu}"
        )
    lines += ["", f"{'replicas':>8} {'lag p50 ms':>10} {'lag p99 ms':>10} {'delivered':>9}"]
    for replicas, lag in sorted(lags.items()):
        lines.append(
            f"{replicas:>8} {_num(lag['lag_p50_ms'], 2):>10} {_num(lag['lag_p99_ms'], 2):>10} "
            f"{lag['delivered_fraction']:>9.3f}"
        )
    lines.append(
        f"\ningest per replica: {ingest['ops_per_s']:,.0f} block ops/s "
        f"(stores {ingest['store_ops_per_s']:,.0f}/s, batches of {ingest['batch']:.0f})"
    )
    return "\n".join(lines)


def verdicts(
    rows: list[MeshRow], lags: dict[int, dict[str, float]], ingest: dict[str, float]
) -> list[Verdict]:
    """The targets: hit rate at the most replicas within 1 point of one replica, lag, ingest."""
    out = []
    for workload in dict.fromkeys(r.workload for r in rows):
        mine = sorted((r for r in rows if r.workload == workload), key=lambda r: r.replicas)
        if len(mine) >= 2:
            first, last = mine[0], mine[-1]
            drop = 100 * (first.hit_rate - last.hit_rate)
            out.append(
                Verdict(
                    f"hit-rate drop {first.replicas}->{last.replicas} replicas, workload {workload} (points)",
                    drop,
                    f"<= {HIT_RATE_POINTS}",
                    not math.isnan(drop) and drop <= HIT_RATE_POINTS,
                )
            )
    for replicas, lag in sorted(lags.items()):
        p99 = lag["lag_p99_ms"]
        ok = p99 < LAG_P99_MS and lag["delivered_fraction"] == 1.0
        out.append(
            Verdict(
                f"replication lag p99 with {replicas} replicas (ms, all delivered)",
                p99,
                f"< {LAG_P99_MS:.0f}",
                ok,
            )
        )
    rate = ingest["ops_per_s"]
    out.append(
        Verdict(
            "ingest per replica (block ops/s)", rate, f">= {INGEST_OPS_PER_S:,.0f}", rate >= INGEST_OPS_PER_S
        )
    )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", default="1,2,4,8", help="comma-separated replica counts")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--profile", default="a40-qwen1.5b")
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--requests", type=int, default=36, help="per workload and replica count")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lag-writes", type=int, default=200)


def measure_cluster(replicas: int, args: argparse.Namespace, state_dir: Path) -> list[MeshRow]:
    """A fresh cluster with ``replicas`` routers: every workload through HAProxy, then stop it."""
    up(
        UpOptions(
            routers=replicas,
            engines=args.engines,
            profile=args.profile,
            time_scale=args.time_scale,
            state_dir=state_dir,
            timeout=180,
        )
    )
    try:
        state = load(state_dir)

        async def drive() -> list[MeshRow]:
            rows = []
            for workload in WORKLOADS:
                options = MeasureOptions(workload, seed=args.seed, requests=args.requests, max_tokens=16)
                run = await run_workload(state, f"{replicas} replicas", options, args.concurrency)
                rows.append(MeshRow.of(replicas, run))
            return rows

        return trio.run(drive)
    finally:
        down(state_dir)


def run(args: argparse.Namespace, log_dir: Path) -> int:
    """Entry of ``kvmesh bench mesh``; exits 1 when a target fails."""
    counts = [int(x) for x in args.replicas.split(",") if x]
    rows: list[MeshRow] = []
    try:
        for replicas in counts:
            print(f"mesh bench: {replicas} replicas", file=sys.stderr, flush=True)
            rows += measure_cluster(replicas, args, log_dir / f"replicas-{replicas}")
    except (ClusterError, StartError) as exc:
        print(f"kvmesh bench mesh: {exc}", file=sys.stderr)
        return 2
    lags = {n: trio.run(measure.replication_lag, args.lag_writes, 0.005, n) for n in counts if n >= 2}
    ingest = measure.ingest_rate()
    print(format_rows(rows, lags, ingest))
    judged = verdicts(rows, lags, ingest)
    for verdict in judged:
        print(verdict.line())
    return 1 if any(not v.passed for v in judged) else 0
