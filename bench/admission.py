"""``kvmesh bench admission``: what the shedding threshold trades, measured on simulated engines.

For each ``admission.queue_threshold`` a fresh fleet and router take the same closed-loop load (32
clients): a client whose request is shed backs off for the router's Retry-After, as OpenAI's clients do.
A low threshold keeps engine queues short (low TTFT for what is admitted) at the cost of rejections and,
below the fleet's saturation point, of throughput.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.client import HttpClient, completion, model_name
from bench.processes import StartFailed, free_port_range, python_module, spawned, wait_ready
from bench.runner import FleetSpec, sim_fleet
from bench.stats import RequestResult, Summary, summarize
from bench.workloads import unique_prompts
from cluster.router_config import write_router_config

THRESHOLDS = (4, 8, 16, 32)
RETRY_AFTER_S = 1.0
"""``admission.queue_retry_after_s`` in the router config and the clients' back-off after a 429."""


def log_folder(given: Path | None) -> Path:
    """Where child processes log: the given folder, or a new temporary one (named on stderr)."""
    folder = given or Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
    print(f"process logs: {folder}", file=sys.stderr)
    return folder


@asynccontextmanager
async def configured_router(client: HttpClient, engines: list[str], config: Path, log_dir: Path,
                            label: str) -> AsyncIterator[str]:
    """A router started from a config file; yields its URL once ``/ready`` says an engine is routable."""
    port = free_port_range(1)
    args = ["router", "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    for url in engines:
        args += ["--engine", url]
    log = log_dir / f"router-{label}-{port}.log"
    async with spawned(python_module("gateway.cli", *args), log) as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(client, url + "/ready", proc, log)
        yield url


@dataclass
class SweepRow:
    threshold: int
    summary: Summary
    rejected: int


async def closed_loop_with_backoff(client: HttpClient, url: str, bodies: list[dict], concurrency: int,
                                   duration: float, timeout: float) -> tuple[list[RequestResult], float]:
    """``concurrency`` clients send back to back for ``duration`` seconds; after a 429 a client waits
    RETRY_AFTER_S. Returns every result (429s included) and the wall time."""
    results: list[RequestResult] = []
    t0 = trio.current_time()
    target = url + "/v1/chat/completions"

    async def worker(index: int) -> None:
        sent = 0
        while trio.current_time() - t0 < duration:
            body = bodies[(index + sent * concurrency) % len(bodies)]
            result = await completion(client, target, body, timeout, started=trio.current_time() - t0)
            results.append(result)
            sent += 1
            if result.status == 429:
                await trio.sleep(RETRY_AFTER_S)

    async with trio.open_nursery() as nursery:
        for index in range(concurrency):
            nursery.start_soon(worker, index)
    return results, trio.current_time() - t0


async def sweep(spec: FleetSpec, log_dir: Path, thresholds: tuple[int, ...], concurrency: int, duration: float,
                prompt_tokens: int, max_tokens: int, timeout: float = 60.0) -> list[SweepRow]:
    """One fresh fleet and router per threshold, the same load on each."""
    client = HttpClient()
    rows = []
    try:
        for threshold in thresholds:
            config = write_router_config(
                log_dir / f"admission-{threshold}.toml", {"metrics_interval_s": 0.25},
                {"admission": {"queue_threshold": threshold, "queue_retry_after_s": RETRY_AFTER_S}})
            async with (sim_fleet(client, spec, log_dir) as engines,
                        configured_router(client, engines, config, log_dir, f"q{threshold}") as url):
                model = await model_name(client, url)
                prompts = unique_prompts(seed=threshold, count=4 * concurrency, tokens=prompt_tokens,
                                         max_tokens=max_tokens)
                bodies = [c.body(model, stream=True) for c in prompts]
                results, wall = await closed_loop_with_backoff(client, url, bodies, concurrency, duration, timeout)
            await client.aclose()
            row = SweepRow(threshold, summarize(results, wall), sum(1 for r in results if r.status == 429))
            rows.append(row)
            print(f"  threshold {threshold}: {row.summary.requests} requests, {row.rejected} rejected",
                  file=sys.stderr, flush=True)
    finally:
        await client.aclose()
    return rows


def format_sweep(rows: list[SweepRow]) -> str:
    head = (f"{'threshold':>9} {'requests':>8} {'rejected':>8} {'rej %':>6} {'other err':>9} {'ok req/s':>8} "
            f"{'ttft p50 ms':>11} {'ttft p95 ms':>11}")
    lines = [head, "-" * len(head)]
    for row in rows:
        s = row.summary
        other = s.errors - row.rejected
        share = 100 * row.rejected / s.requests if s.requests else 0.0
        lines.append(f"{row.threshold:>9} {s.requests:>8} {row.rejected:>8} {share:>6.1f} {other:>9} "
                     f"{s.req_per_s:>8.1f} {s.ttft_p50 * 1000:>11.1f} {s.ttft_p95 * 1000:>11.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``kvmesh bench admission [--thresholds 4,8,16,32] [--concurrency 32] [--duration S] ...``."""
    p = argparse.ArgumentParser(prog="kvmesh bench admission", description=__doc__)
    p.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)), help="comma-separated")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=12.0, help="seconds of load per threshold")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--profile", default="a40-qwen1.5b")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--log-dir", type=Path, help="child process logs (default: a new temporary folder)")
    args = p.parse_args(argv)
    log_dir = log_folder(args.log_dir)
    thresholds = tuple(int(t) for t in args.thresholds.split(",") if t)
    spec = FleetSpec(args.engines, args.profile, args.time_scale, max_num_seqs=256)
    try:
        rows = trio.run(sweep, spec, log_dir, thresholds, args.concurrency, args.duration, args.prompt_tokens,
                        args.max_tokens)
    except StartFailed as exc:
        print(f"kvmesh bench admission: {exc}", file=sys.stderr)
        return 2
    print(f"admission sweep: {args.engines} engines ({args.profile}, time scale {args.time_scale}), "
          f"c={args.concurrency}, {args.duration:.0f} s per threshold, 429 -> back off {RETRY_AFTER_S:.0f} s")
    print(format_sweep(rows))
    return 0
