"""``kvmesh demo``: a 3-replica meshed kvmesh behind HAProxy vs round robin, on the same workloads.

Each policy gets its own fresh cluster (fresh engine caches), the same workloads are sent through
HAProxy, and the engines' own /metrics say how much prompt was served from cache. The cluster is
always stopped, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench.cluster_run import ClusterRun, run_workload
from bench.report import format_table
from bench.runner import MeasureOptions
from cluster.daemon import StartError
from cluster.local import ClusterError, UpOptions, down, up
from cluster.state import load

POLICIES = ("kv_aware", "round_robin")
WORKLOADS = {"a": "shared documents", "c": "multi-turn chats"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh demo", description=__doc__)
    p.add_argument("--routers", type=int, default=3)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--profile", default="a40-qwen1.5b")
    p.add_argument("--time-scale", type=float, default=0.5, help="simulated engine time multiplier")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=48, help="per workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-dir", type=Path, help="default: a new temporary folder (logs stay there)")
    return p


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}%"


def report(runs: list[ClusterRun]) -> str:
    """The table, per-replica traffic and CPU, and the hit-rate comparison per workload."""
    lines = [format_table([r.row for r in runs]), "", "requests per replica (from router /metrics):"]
    for run in runs:
        spread = "  ".join(
            f"{name} {count:.0f} ({share * 100:.0f}%) cpu {cpu:.1f}s"
            for name, count, share, cpu in zip(
                run.replicas, run.replica_requests, run.replica_share, run.replica_cpu_s, strict=True
            )
        )
        lines.append(f"  {run.row.workload} {run.row.label:<12} {spread}")
    lines.append("")
    for workload, title in WORKLOADS.items():
        by_policy = {r.row.label: r.row for r in runs if r.row.workload == workload}
        if set(POLICIES) <= set(by_policy):
            kv, rr = by_policy["kv_aware"], by_policy["round_robin"]
            kv_s, rr_s = kv.summary, rr.summary
            lines.append(
                f"{title}: engine prefix-cache hit rate {_pct(kv.hit_rate)} with kvmesh vs "
                f"{_pct(rr.hit_rate)} round robin; TTFT p50 {kv_s.ttft_p50 * 1000:.0f} ms vs "
                f"{rr_s.ttft_p50 * 1000:.0f} ms; errors {kv_s.errors} vs {rr_s.errors}"
            )
    return "\n".join(lines)


async def _drive(state_dir: Path, policy: str, args: argparse.Namespace) -> list[ClusterRun]:
    state = load(state_dir)
    runs = []
    for workload in WORKLOADS:
        options = MeasureOptions(workload, seed=args.seed, requests=args.requests, max_tokens=16)
        run = await run_workload(state, policy, options, args.concurrency)
        s = run.row.summary
        print(
            f"  {policy} {workload}: {s.requests} requests, {s.errors} errors, hit {_pct(run.row.hit_rate)}, "
            f"{run.wall_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        runs.append(run)
    return runs


def run_policy(policy: str, args: argparse.Namespace, state_dir: Path) -> list[ClusterRun]:
    """Start a fresh cluster for ``policy``, run every workload through it, always stop it."""
    options = UpOptions(
        routers=args.routers,
        engines=args.engines,
        policy=policy,
        profile=args.profile,
        time_scale=args.time_scale,
        state_dir=state_dir,
        redis=True,
    )
    print(
        f"starting {args.routers} {policy} routers + {args.engines} engines behind HAProxy, with Redis",
        file=sys.stderr,
    )
    up(options)
    try:
        return trio.run(_drive, state_dir, policy, args)
    finally:
        down(state_dir)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    base = args.state_dir or Path(tempfile.mkdtemp(prefix="kvmesh-demo-"))
    started = time.monotonic()
    runs: list[ClusterRun] = []
    try:
        for policy in POLICIES:
            runs += run_policy(policy, args, base / policy)
    except (ClusterError, StartError, OSError) as exc:
        print(f"kvmesh demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvmesh demo: interrupted; cluster stopped", file=sys.stderr)
        return 130
    print(report(runs))
    print(f"\ndemo took {time.monotonic() - started:.0f} s; logs in {base}")
    return 0 if all(r.row.summary.errors == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
