"""``kvmesh bench tiers``: a working set twice the fleet's GPU cache that fits in GPU + CPU, routed with the
engines' CPU tiers priced and with them ignored, in one run.

Two identical simulated fleets, each engine with a CPU tier (sim/cpu_tier.py), each behind its own router:
one prices a block in an engine's CPU tier as its load time (the default), the other has
``engines[].tiers.enabled = false`` and sees GPU blocks only. Documents are asked several times in a shuffled
order, so most asks find their document evicted from every GPU cache but still in one engine's CPU tier:
a router that sees the tier sends the ask there and the engine loads the blocks instead of recomputing them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.admission import configured_router, log_folder
from bench.client import HttpClient, model_name, run_closed_loop
from bench.processes import StartFailed
from bench.runner import FleetSpec, sim_fleet
from bench.stats import Summary, summarize
from bench.workloads import shared_documents


@dataclass(frozen=True)
class TieredFleetSpec(FleetSpec):
    cpu_blocks: int = 0

    def argv(self, base_port: int) -> list[str]:
        return [*super().argv(base_port), "--cpu-blocks", str(self.cpu_blocks)]


@dataclass
class TierRow:
    label: str
    summary: Summary
    cached_share: float
    """Prompt tokens the engines served from cache (GPU hits and CPU-tier loads, their usage reports)."""


def router_toml(engines: list[str], tiers: bool) -> str:
    """A router config naming the engines, with their tiers priced or ignored."""
    lines = ["metrics_interval_s = 0.25"]
    for url in engines:
        lines += ["[[engines]]", f'url = "{url}"', "[engines.tiers]", f"enabled = {'true' if tiers else 'false'}"]
    return "\n".join(lines) + "\n"


async def _one(spec: TieredFleetSpec, log_dir: Path, label: str, tiers: bool, args: argparse.Namespace) -> TierRow:
    client = HttpClient()
    try:
        async with sim_fleet(client, spec, log_dir) as engines:
            config = log_dir / f"router-{label}.toml"
            config.write_text(router_toml(engines, tiers))
            async with configured_router(client, engines, config, log_dir, label) as url:
                model = await model_name(client, engines[0])
                conversations = shared_documents(args.seed, documents=args.documents,
                                                 doc_tokens=(args.doc_tokens, args.doc_tokens),
                                                 asks=(args.asks, args.asks), max_tokens=args.max_tokens)
                results, wall = await run_closed_loop(client, url, conversations, args.concurrency, model,
                                                      timeout=args.timeout)
    finally:
        await client.aclose()
    prompt = sum(r.prompt_tokens or 0 for r in results)
    cached = sum(r.cached_tokens or 0 for r in results)
    return TierRow(label, summarize(results, wall), cached / prompt if prompt else 0.0)


async def compare(spec: TieredFleetSpec, log_dir: Path, args: argparse.Namespace) -> list[TierRow]:
    """Tiers priced and tiers ignored, at the same time (the machine's noise falls on both alike), on
    identical fleets with the same requests."""
    rows: dict[str, TierRow] = {}

    async def one(label: str, tiers: bool) -> None:
        rows[label] = await _one(spec, log_dir, label, tiers, args)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "tiers", True)
        nursery.start_soon(one, "gpu-only", False)
    return [rows["tiers"], rows["gpu-only"]]


def format_tiers(rows: list[TierRow]) -> str:
    head = (f"{'router sees':<12} {'requests':>8} {'errors':>6} {'cached %':>8} {'ttft p50 ms':>11} "
            f"{'ttft p95 ms':>11} {'req/s':>6}")
    lines = [head, "-" * len(head)]
    for row in rows:
        s = row.summary
        lines.append(f"{row.label:<12} {s.requests:>8} {s.errors:>6} {100 * row.cached_share:>8.1f} "
                     f"{s.ttft_p50 * 1000:>11.1f} {s.ttft_p95 * 1000:>11.1f} {s.req_per_s:>6.2f}")
    if len(rows) == 2 and rows[0].summary.ttft_p50 > 0:
        ratio = rows[1].summary.ttft_p50 / rows[0].summary.ttft_p50
        lines.append(f"fleet TTFT p50, GPU-only view / tiers priced: x{ratio:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``kvmesh bench tiers [--documents 48] [--doc-tokens 1024] [--asks 3] ...``."""
    p = argparse.ArgumentParser(prog="kvmesh bench tiers", description=__doc__)
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--profile", default="h100-70b", help="prefill long enough that the machine's noise is small")
    p.add_argument("--num-blocks", type=int, default=512, help="GPU blocks per engine")
    p.add_argument("--cpu-blocks", type=int, default=2048, help="CPU-tier blocks per engine")
    p.add_argument("--documents", type=int, default=48, help="of --doc-tokens each: twice the GPU tier by default")
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--asks", type=int, default=3, help="asks per document, shuffled")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--log-dir", type=Path, help="child process logs (default: a new temporary folder)")
    args = p.parse_args(argv)
    log_dir = log_folder(args.log_dir)
    spec = TieredFleetSpec(args.engines, args.profile, num_blocks=args.num_blocks, cpu_blocks=args.cpu_blocks)
    try:
        rows = trio.run(compare, spec, log_dir, args)
    except StartFailed as exc:
        print(f"kvmesh bench tiers: {exc}", file=sys.stderr)
        return 2
    gpu_blocks = args.engines * (args.num_blocks - 1)
    working = args.documents * (args.doc_tokens // spec.block_size)
    print(f"tiers: {args.engines} engines ({args.profile}), GPU {gpu_blocks} blocks, CPU tier "
          f"{args.engines * args.cpu_blocks} blocks, working set {working} blocks (x{working / gpu_blocks:.1f} "
          f"the GPU tier), {args.documents} documents x {args.asks} asks, c={args.concurrency}")
    print(format_tiers(rows))
    return 0
