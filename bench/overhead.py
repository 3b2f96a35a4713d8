"""What the router adds: the same small requests sent to one engine directly and through the router.

Direct and routed blocks alternate (A B B A ...) in one run so machine noise hits both alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.client import HttpClient, model_name, run_closed_loop
from bench.runner import FleetSpec, router, sim_fleet
from bench.stats import RequestResult, Summary, summarize
from bench.workloads import unique_prompts


@dataclass
class OverheadRow:
    path: str
    stream: bool
    summary: Summary


def block_order(rounds: int) -> list[str]:
    """ABBA ordering: each side goes first equally often, cancelling drift within the run."""
    order = []
    for r in range(rounds):
        order += ["direct", "router"] if r % 2 == 0 else ["router", "direct"]
    return order


async def measure_overhead(
    spec: FleetSpec,
    log_dir: Path,
    concurrency: int = 8,
    requests: int = 200,
    rounds: int = 4,
    policy: str = "kv_aware",
) -> list[OverheadRow]:
    """Closed-loop blocks of ``requests`` tiny prompts, non-streaming and streaming, both paths."""
    client = HttpClient()
    collected: dict[tuple[str, bool], tuple[list[RequestResult], float]] = {}
    try:
        async with sim_fleet(client, spec, log_dir) as engines, router(client, engines, policy, log_dir) as url:
            targets = {"direct": engines[0], "router": url}
            model = await model_name(client, engines[0])
            for i, path in enumerate(block_order(rounds)):
                for stream in (False, True):
                    convs = unique_prompts(seed=1 + 2 * i + stream, count=requests, tokens=16, max_tokens=4)
                    results, wall = await run_closed_loop(client, targets[path], convs, concurrency, model, stream)
                    done, total_wall = collected.get((path, stream), ([], 0.0))
                    collected[(path, stream)] = (done + results, total_wall + wall)
    finally:
        await client.aclose()
    return [OverheadRow(p, s, summarize(res, wall)) for (p, s), (res, wall) in sorted(collected.items())]


def format_overhead(rows: list[OverheadRow]) -> str:
    """Per mode: both paths' numbers and the router's added p50/p99 latency and throughput ratio."""
    lines = [f"{'mode':<10} {'path':<7} {'reqs':>5} {'errs':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}"]
    by_key = {(r.path, r.stream): r.summary for r in rows}
    for stream in (False, True):
        mode = "stream" if stream else "plain"
        for path in ("direct", "router"):
            s = by_key.get((path, stream))
            if s:
                lines.append(
                    f"{mode:<10} {path:<7} {s.requests:>5} {s.errors:>4} {s.req_per_s:>8.1f} "
                    f"{s.latency_p50 * 1000:>8.2f} {s.latency_p99 * 1000:>8.2f}"
                )
        direct, routed = by_key.get(("direct", stream)), by_key.get(("router", stream))
        if direct and routed and direct.req_per_s:
            lines.append(
                f"{mode:<10} router adds p50 {(routed.latency_p50 - direct.latency_p50) * 1000:+.2f} ms, "
                f"p99 {(routed.latency_p99 - direct.latency_p99) * 1000:+.2f} ms, "
                f"req/s x{routed.req_per_s / direct.req_per_s:.2f}"
            )
    return "\n".join(lines)
