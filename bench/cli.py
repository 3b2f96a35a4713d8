"""``kvmesh bench``: compare routing policies, measure router overhead, check the targets."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

import trio

from bench import mesh, overhead_sweep, scale, suite, suite_report
from bench.overhead import (
    ANSWER_TOKENS,
    PEERS,
    format_answer_cost,
    format_engine_view,
    format_overhead,
    format_revision_comparison,
    format_system_prompt,
    known_peer,
    measure_overhead,
    measure_system_prompt,
    system_prompt_cases,
    with_answer_lengths,
)
from bench.peers import smg_binary
from bench.processes import StartFailed
from bench.report import Row, format_table, verdicts
from bench.runner import FleetSpec, MeasureOptions, compare_policies, measure_target
from bench.workloads import PARTITION_NUM_BLOCKS, WORKLOAD_NAMES
from sim.profiles import PROFILES

TARGET_PLAN: tuple[tuple[str, tuple[int, ...], tuple[str, ...], bool], ...] = (
    ("a", (1,), ("kv_aware", "round_robin"), False),
    ("b", (1, 32), ("kv_aware", "round_robin"), False),
    ("d", (8,), ("kv_aware", "approximate", "round_robin"), False),
    ("d", (8,), ("kv_aware", "approximate"), True),
)
"""What ``targets`` runs: (workload, concurrencies, policies, through --routers replicas). Each target
compares the policies it names; (d) runs on one router and again on several, where each approximate
replica only knows the requests it sent itself."""

# Measurements with a command line of their own: name -> module with main(argv) -> int.
DELEGATED = {"tokenize": "bench.tokenize_cost", "index": "bench.index_cost", "admission": "bench.admission",
             "tenants": "bench.tenants", "decide": "bench.decide_cost", "autoscale": "bench.autoscale",
             "ingest": "bench.ingest_cost", "pd": "bench.pd", "tiers": "bench.tiers"}

SMALL_CACHE_BLOCKS = 256
"""Blocks per engine for workload d, so its working set is a few times the fleet's capacity."""


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _fleet_args(p: argparse.ArgumentParser, profile: str) -> None:
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--profile", choices=sorted(PROFILES), default=profile,
                   help="the simulated engines' cost model: fast (near-zero modelled time, the engine's own CPU is "
                        "its bottleneck), a40-qwen1.5b or h100-70b (modelled GPU steps)")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--num-blocks", type=int, help="KV blocks per engine (default 4096; 256 for d, 160 for e)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--log-dir", type=Path, help="child process logs (default: a new temporary folder)")


def _measure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, help="scale the workload (default: the workload's own size)")
    p.add_argument("--max-tokens", type=int, help="answer length (default: the workload's, 16; 128 for d)")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--tokenizer", help="the engines' tokenizer: for the router and for counting shared prefixes")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="kvmesh bench", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)
    routing = sub.add_parser("routing", help="policies side by side on one workload")
    routing.add_argument("--workload", choices=WORKLOAD_NAMES, default="a")
    routing.add_argument("--concurrency", type=_int_list, default=[1, 32], help="comma-separated")
    routing.add_argument("--policies", help="comma-separated (default kv_aware,round_robin,approximate; with --suite "
                         "also smg:cache_aware when smg is found); smg:POLICY runs that peer router (bench/peers.py), "
                         "POLICY@REV kvmesh's router at git revision REV; with --suite a policy listed twice "
                         "runs twice ('kv_aware #2'), and its second run is set against its first (noise floor)")
    routing.add_argument("--target", help="drive this OpenAI URL instead of starting routers")
    routing.add_argument("--label", default="target", help="row name for --target")
    routing.add_argument("--engine-metrics", nargs="*", default=[], help="engine URLs whose /metrics to diff")
    routing.add_argument("--routers", type=int, default=1, help="router replicas per policy (kv_aware meshed)")
    routing.add_argument("--runs", type=int, default=1, help="consecutive runs per policy on the same warm engines")
    suite_args = routing.add_argument_group("suite: shapes drawn at random, each row against its offline bound")
    suite_args.add_argument("--suite", action="store_true", help=f"draw {suite.DEFAULT_SHAPES} shapes (--seed) "
                            "instead of running --workload")
    suite_args.add_argument("--quick", action="store_true", help=f"{suite.QUICK_SHAPES} shapes")
    suite_args.add_argument("--shapes", type=int, help="how many shapes to draw")
    suite_args.add_argument("--only", type=_int_list, default=[], help="comma-separated shape numbers of the "
                            "drawn suite to run (e.g. 12 reruns shape #12 as drawn)")
    suite_args.add_argument("--budget-s", type=float, default=suite.BUDGET_S, help="wall seconds one run is sized to")
    suite_args.add_argument("--mesh-replicas", type=int, default=3, help="meshed replicas of --mesh-policies "
                            "(0: none)")
    suite_args.add_argument("--mesh-policies", default="kv_aware")
    suite_args.add_argument("--mesh-kill", action="store_true", help="also run the meshed replicas with one of "
                            "them killed halfway through each shape (kv_aware x3>2)")
    suite_args.add_argument("--plot", type=Path, help="PNG of fraction of bound per shape (default: in --log-dir)")
    _fleet_args(routing, "a40-qwen1.5b")
    _measure_args(routing)
    targets = sub.add_parser("targets", help="run workloads a, b and d and judge the targets")
    targets.add_argument("--routers", type=int, default=2, help="router replicas for the multi-router (d) rows")
    _fleet_args(targets, "a40-qwen1.5b")
    _measure_args(targets)
    overhead = sub.add_parser("overhead", help="router vs direct engine: req/s and added latency")
    overhead.add_argument("--concurrency", type=int, default=8)
    overhead.add_argument("--requests", type=int, default=200, help="per block")
    overhead.add_argument("--rounds", type=int, default=4)
    overhead.add_argument("--policy", default="kv_aware")
    overhead.add_argument("--workload", choices=("system", "tiny"), default="system",
                          help="system: 1,500-token shared system prompt + fresh user turn, streamed, c=1 and "
                               "c=64; tiny: small unique prompts at --concurrency")
    overhead.add_argument("--peers", default=None,
                          help=f"comma-separated peer routers in the same run ({', '.join(PEERS)}, or "
                               "kvmesh@REV / passthrough@REV: that git revision's code); with --pin the default "
                               "is passthrough, and smg when it is installed")
    overhead.add_argument("--pin", action="store_true",
                          help="the router under test alone on the last CPU, engine and load on the others, "
                               "and a sweep over --sweep concurrencies (system workload)")
    overhead.add_argument("--sweep", type=_int_list, default=list(overhead_sweep.SWEEP),
                          help="comma-separated concurrencies for --pin")
    overhead.add_argument("--short", action="store_true",
                          help="with --pin: two requests per stream per block instead of four")
    overhead.add_argument("--c1-requests", type=int, default=None,
                          help="with --pin: requests per c=1 block (default 40, 20 with --short)")
    overhead.add_argument("--plot", type=Path,
                          help="with --pin: PNG path (default: overhead-sweep.png in the log folder)")
    overhead.add_argument("--answer-tokens", type=_int_list, default=[ANSWER_TOKENS],
                          help=f"comma-separated answer lengths (system workload, default {ANSWER_TOKENS}): every "
                               "case runs once per length, and each router's CPU per relayed token is printed")
    _fleet_args(overhead, "fast")
    mesh_bench = sub.add_parser("mesh", help="1..8 replicas behind HAProxy: hit rate, TTFT, lag, ingest, CPU")
    mesh.add_arguments(mesh_bench)
    mesh_bench.add_argument("--log-dir", type=Path, help="state and logs (default: a new temp folder)")
    scale_bench = sub.add_parser("scale", help="E synthetic engines' events into R meshed replicas: CPU and RSS "
                                 "per block, lag, convergence, serving under a burst")
    scale.add_arguments(scale_bench)
    scale_bench.add_argument("--log-dir", type=Path, help="process logs, plot and results (default: a new temp folder)")
    return root


def _spec(args: argparse.Namespace, workload: str, engines: int | None = None) -> FleetSpec:
    blocks = args.num_blocks or {"d": SMALL_CACHE_BLOCKS, "e": PARTITION_NUM_BLOCKS}.get(workload, 4096)
    return FleetSpec(
        engines or args.engines, args.profile, args.time_scale, blocks, args.block_size, args.max_num_seqs
    )


def _options(args: argparse.Namespace, workload: str) -> MeasureOptions:
    return MeasureOptions(
        workload, args.seed, args.requests, args.max_tokens, args.timeout,
        block_size=args.block_size, tokenizer=args.tokenizer,
    )  # fmt: skip


async def _routing(args: argparse.Namespace, log_dir: Path) -> list[Row]:
    spec = _spec(args, args.workload)
    options = _options(args, args.workload)
    if args.target:
        return await measure_target(
            args.target, args.label, args.engine_metrics, args.concurrency, options, spec.capacity_tokens
        )
    policies = _names(args.policies or "kv_aware,round_robin,approximate")
    return await compare_policies(
        spec, policies, args.concurrency, options, log_dir, args.tokenizer, args.routers, args.runs
    )


async def _targets(args: argparse.Namespace, log_dir: Path) -> list[Row]:
    rows: list[Row] = []
    for workload, concurrencies, policies, replicated in TARGET_PLAN:
        if replicated and args.routers < 2:
            continue
        rows += await compare_policies(
            _spec(args, workload), list(policies), list(concurrencies), _options(args, workload), log_dir,
            args.tokenizer, args.routers if replicated else 1,
        )  # fmt: skip
    return rows


def _names(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def _suite(args: argparse.Namespace, log_dir: Path) -> int:
    count = args.shapes or (suite.QUICK_SHAPES if args.quick else suite.DEFAULT_SHAPES)
    policies = _names(args.policies) if args.policies else suite.default_policies()
    todo = suite.entries(policies, _names(args.mesh_policies), args.mesh_replicas, args.mesh_kill)
    fleet = _spec(args, "suite")
    options = _options(args, "suite")
    runs = trio.run(suite.run_suite, args.seed, count, todo, fleet, options, args.budget_s, log_dir,
                    frozenset(args.only))
    print(suite_report.format_shapes(runs))
    print()
    print(f"suite seed {args.seed}, {len(runs)} shapes, policies {', '.join(e.label for e in todo)}")
    print(suite_report.format_overall(runs))
    if reruns := suite_report.format_reruns(runs):
        print()
        print(reruns)
    plot = args.plot or log_dir / f"suite-{args.seed}.png"
    suite_report.plot(runs, plot)
    print(f"plot: {plot}")
    judged = suite_report.verdicts(runs)
    for verdict in judged:
        print(verdict.line())
    return 1 if any(not v.passed for v in judged) else 0


def _overhead(args: argparse.Namespace, log_dir: Path) -> int:
    spec = _spec(args, "", engines=1)
    if args.workload == "tiny":
        rows = trio.run(measure_overhead, spec, log_dir, args.concurrency, args.requests, args.rounds, args.policy)
        print(format_overhead(rows))
        return 0
    peer_names = [p for p in (args.peers if args.peers is not None else _default_peers(args.pin)).split(",") if p]
    unknown = {p for p in peer_names if not known_peer(p)}
    if unknown:
        raise SystemExit(f"kvmesh bench overhead: unknown peers {sorted(unknown)}; known: {', '.join(PEERS)}, "
                         "kvmesh@REV, passthrough@REV")
    if not args.pin:
        cases = with_answer_lengths(system_prompt_cases(), args.answer_tokens)
        blocks = trio.run(measure_system_prompt, spec, log_dir, args.rounds, args.policy, peer_names, cases)
        print(format_system_prompt(blocks))
        print(format_engine_view(blocks))
        print(format_revision_comparison(blocks))
        print(format_answer_cost(blocks, cases))
        return 0
    pinning = overhead_sweep.pin_this_process()
    spec = overhead_sweep.fleet_for_sweep(spec, args.sweep)
    print(f"router under test on CPU {sorted(pinning.router)}, engine and load on CPU {sorted(pinning.rest)}; "
          f"engine profile {spec.profile}, max_num_seqs {spec.max_num_seqs}; {overhead_sweep.load_average()}")
    cases = with_answer_lengths(overhead_sweep.sweep_cases(args.sweep, args.short, args.c1_requests),
                                args.answer_tokens)
    blocks = trio.run(measure_system_prompt, spec, log_dir, args.rounds, args.policy, peer_names, cases,
                      pinning.router)
    print(format_system_prompt(blocks))
    print(format_engine_view(blocks))
    print(format_revision_comparison(blocks))
    print(format_answer_cost(blocks, cases))
    print(overhead_sweep.load_average())
    for line in overhead_sweep.verdicts(blocks, args.sweep):
        print(line)
    plot = args.plot or log_dir / "overhead-sweep.png"
    overhead_sweep.plot(blocks, args.sweep, args.answer_tokens, plot)
    print(f"plot: {plot}")
    return 0


def _default_peers(pin: bool) -> str:
    """Without --pin no peer unless asked; with it the floor, and smg when it can be found."""
    if not pin:
        return ""
    try:
        smg_binary()
    except StartFailed:
        return "passthrough"
    return "smg,passthrough"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvmesh bench``; exits 1 when a judged target fails."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        return importlib.import_module(DELEGATED[argv[0]]).main(argv[1:])
    args = parser().parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
    print(f"process logs: {log_dir}", file=sys.stderr)
    try:
        if args.command == "mesh":
            return mesh.run(args, log_dir)
        if args.command == "scale":
            return scale.run(args, log_dir)
        if args.command == "overhead":
            return _overhead(args, log_dir)
        if args.command == "routing" and args.suite:
            return _suite(args, log_dir)
        table_rows = trio.run(_routing if args.command == "routing" else _targets, args, log_dir)
    except StartFailed as exc:
        print(f"kvmesh bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(table_rows))
    judged = verdicts(table_rows)
    for verdict in judged:
        print(verdict.line())
    return 1 if any(not v.passed for v in judged) else 0


if __name__ == "__main__":
    sys.exit(main())
