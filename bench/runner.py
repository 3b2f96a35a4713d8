"""Policy comparisons: a fresh simulated fleet and router per policy, measured back to back.

Every (concurrency, policy) pair gets new engines, so no policy inherits another's warm cache, and
the policies of one concurrency run one after the other on the same noisy machine.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from bench import engine_stats, workloads
from bench.client import ROUTE_HEADER, HttpClient, model_name, run_closed_loop
from bench.processes import free_port_range, python_module, spawned, wait_ready
from bench.report import Row
from bench.stats import shares, summarize

PRIMED_WORKLOADS = ("a",)
SIM_PORT_OFFSETS = (0, 1000, 2000)
"""HTTP, KV-event and replay ports of simulated engine i sit at base+i plus these (sim/cli.py)."""


@dataclass(frozen=True)
class FleetSpec:
    """The simulated engines' command line (see ``sim/cli.py``)."""

    engines: int = 3
    profile: str = "a40-qwen1.5b"
    time_scale: float = 1.0
    num_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 64

    @property
    def capacity_tokens(self) -> int:
        return self.engines * self.num_blocks * self.block_size

    def argv(self, base_port: int) -> list[str]:
        return [
            "--engines", str(self.engines), "--base-port", str(base_port), "--profile", self.profile,
            "--time-scale", str(self.time_scale), "--num-blocks", str(self.num_blocks),
            "--block-size", str(self.block_size), "--max-num-seqs", str(self.max_num_seqs),
        ]  # fmt: skip


@dataclass(frozen=True)
class MeasureOptions:
    """What to send and how: the same for every row of one comparison."""

    workload: str
    seed: int = 0
    requests: int | None = None
    max_tokens: int = 16
    timeout: float = 120.0
    warmup: int = 6
    route_header: str = ROUTE_HEADER


@asynccontextmanager
async def sim_fleet(client: HttpClient, spec: FleetSpec, log_dir: Path) -> AsyncIterator[list[str]]:
    """Start ``spec.engines`` simulated engines; yields their base URLs."""
    base = free_port_range(spec.engines, SIM_PORT_OFFSETS)
    log = log_dir / f"sim-{base}.log"
    async with spawned(python_module("sim.cli", *spec.argv(base)), log) as proc:
        urls = [f"http://127.0.0.1:{base + i}" for i in range(spec.engines)]
        for url in urls:
            await wait_ready(client, url + "/health", proc, log)
        yield urls


@asynccontextmanager
async def router(
    client: HttpClient, engine_urls: list[str], policy: str, log_dir: Path, tokenizer: str | None = None
) -> AsyncIterator[str]:
    """Start one kvmesh router with ``policy`` in front of the engines; yields its base URL."""
    port = free_port_range(1)
    args = ["router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    for url in engine_urls:
        args += ["--engine", url]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    log = log_dir / f"router-{policy}-{port}.log"
    async with spawned(python_module("gateway.cli", *args), log) as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(client, url + "/health", proc, log)
        yield url


def engine_of(route: str) -> str:
    """The engine named by a route header: its first field (``host:port`` or an engine id)."""
    return route.replace(",", ";").split(";")[0].strip().removeprefix("engine=")


async def measure(
    client: HttpClient,
    label: str,
    url: str,
    engine_urls: list[str],
    concurrency: int,
    options: MeasureOptions,
    capacity_tokens: int = 0,
) -> Row:
    """Warm up, prime if the workload asks for it, then run the workload between two metric scrapes."""
    model = await model_name(client, url)
    convs = workloads.build(options.workload, options.seed, options.requests, capacity_tokens, options.max_tokens)
    warm = workloads.unique_prompts(options.seed, options.warmup)
    if options.workload in PRIMED_WORKLOADS:
        warm += workloads.primers(convs, options.seed)
    await run_closed_loop(client, url, warm, max(1, len(engine_urls)), model, True, options.timeout)
    before = await engine_stats.scrape(client, engine_urls)
    results, wall = await run_closed_loop(
        client, url, convs, concurrency, model, True, options.timeout, options.route_header
    )
    after = await engine_stats.scrape(client, engine_urls)
    deltas = engine_stats.deltas(before, after)
    ids = [urlsplit(u).netloc for u in engine_urls]
    summary = summarize(results, wall)
    routed: dict[str, float] = {}
    for route, count in summary.routes.items():
        routed[engine_of(route)] = routed.get(engine_of(route), 0) + count
    served = {i: d.get(engine_stats.SUCCESSES, 0.0) for i, d in zip(ids, deltas, strict=True)}
    return Row(
        label=label,
        workload=options.workload,
        concurrency=concurrency,
        summary=summary,
        hit_rate=engine_stats.fleet_hit_rate(deltas),
        route_share=shares(routed, ids) if routed else [],
        engine_share=shares(served, ids),
    )


def _progress(row: Row) -> None:
    s = row.summary
    print(
        f"  {row.workload} c={row.concurrency} {row.label}: {s.requests} requests, {s.errors} errors, "
        f"{s.req_per_s:.1f} req/s, hit {row.hit_rate:.3f}",
        file=sys.stderr,
        flush=True,
    )


async def compare_policies(
    spec: FleetSpec,
    policies: list[str],
    concurrencies: list[int],
    options: MeasureOptions,
    log_dir: Path,
    tokenizer: str | None = None,
) -> list[Row]:
    """One row per (concurrency, policy), each on a fresh fleet, policies back to back."""
    client = HttpClient()
    rows = []
    try:
        for concurrency in concurrencies:
            for policy in policies:
                async with (
                    sim_fleet(client, spec, log_dir) as engines,
                    router(client, engines, policy, log_dir, tokenizer) as url,
                ):
                    row = await measure(client, policy, url, engines, concurrency, options, spec.capacity_tokens)
                rows.append(row)
                _progress(row)
                await client.aclose()
    finally:
        await client.aclose()
    return rows


async def measure_target(
    url: str,
    label: str,
    engine_metrics: list[str],
    concurrencies: list[int],
    options: MeasureOptions,
    capacity_tokens: int = 0,
) -> list[Row]:
    """Drive an already running OpenAI server (a peer router, or an engine) with the same workload.

    Its engines are not restarted, so each concurrency level gets its own seed: new text, cold prefixes.
    """
    client = HttpClient()
    rows = []
    try:
        for i, concurrency in enumerate(concurrencies):
            fresh = replace(options, seed=options.seed + 1000 * i)
            row = await measure(client, label, url, engine_metrics, concurrency, fresh, capacity_tokens)
            rows.append(row)
            _progress(row)
    finally:
        await client.aclose()
    return rows
