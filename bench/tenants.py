"""``kvmesh bench tenants``: a noisy tenant floods, a polite one stays within its limit.

One fleet and one router with two metered tenants. Phase 1 measures the polite tenant alone (baseline);
phase 2 sends the same polite load while the noisy tenant floods open-loop far above its limit. The
polite tenant must be served in full, the noisy one held to its limit, and the polite TTFT should stay
near its baseline: shed requests cost the router a little CPU and the engines nothing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import h11
import trio

from bench.admission import configured_router, log_folder
from bench.client import HttpClient, _Connection, completion, model_name, run_open_loop
from bench.processes import StartFailed
from bench.runner import FleetSpec, sim_fleet
from bench.stats import RequestResult, Summary, summarize
from bench.workloads import unique_prompts
from cluster.router_config import write_router_config
from gateway.security.keys import generate_key, hash_key


class _KeyedConnection(_Connection):
    """Adds the tenant's Authorization header to every request head it sends."""

    def __init__(self, stream: trio.SocketStream, authorization: str) -> None:
        super().__init__(stream)
        self.authorization = authorization

    async def send(self, event: h11.Event) -> None:
        if isinstance(event, h11.Request):
            headers = [*event.headers, (b"authorization", self.authorization.encode())]
            event = h11.Request(method=event.method, target=event.target, headers=headers)
        await super().send(event)


@dataclass
class TenantClient(HttpClient):
    """The bench's lean client, speaking as one tenant (bench.client.HttpClient sends no custom headers)."""

    api_key: str = field(default="", repr=False)

    async def _checkout(self, host: str, port: int) -> tuple[_Connection, bool]:
        idle = self._idle[(host, port)]
        if idle:
            return idle.pop(), True
        return _KeyedConnection(await trio.open_tcp_stream(host, port), f"Bearer {self.api_key}"), False


@dataclass
class TenantRow:
    phase: str
    tenant: str
    offered_rps: float
    limit_rps: float
    summary: Summary
    limited: int


async def _open_loop(client: TenantClient, url: str, bodies: list[dict], rate: float, duration: float,
                     timeout: float) -> tuple[list[RequestResult], float]:
    target = url + "/v1/chat/completions"

    async def send(i: int, started: float) -> RequestResult:
        return await completion(client, target, bodies[i % len(bodies)], timeout, started=started)

    report = await run_open_loop(send, rate, duration, max_in_flight=512)
    return report.results, report.wall


async def contention(spec: FleetSpec, log_dir: Path, polite_rps: float, polite_limit: float, noisy_rps: float,
                     noisy_limit: float, duration: float, prompt_tokens: int, max_tokens: int,
                     timeout: float = 60.0) -> list[TenantRow]:
    keys = {"polite": generate_key(), "noisy": generate_key()}
    limits = {"polite": polite_limit, "noisy": noisy_limit}
    config = write_router_config(
        log_dir / "tenants.toml", {"metrics_interval_s": 0.25}, {"auth": {"enabled": True}},
        {"tenants": [{"name": name, "keys": [hash_key(key)], "requests_per_second": limits[name]}
                     for name, key in keys.items()]})
    clients = {name: TenantClient(api_key=key) for name, key in keys.items()}
    rows: list[TenantRow] = []
    try:
        async with (sim_fleet(clients["polite"], spec, log_dir) as engines,
                    configured_router(clients["polite"], engines, config, log_dir, "tenants") as url):
            model = await model_name(clients["polite"], engines[0])

            def bodies(seed: int, count: int) -> list[dict]:
                prompts = unique_prompts(seed, count, tokens=prompt_tokens, max_tokens=max_tokens)
                return [c.body(model, stream=True) for c in prompts]

            polite_count = int(polite_rps * duration) + 1
            results, wall = await _open_loop(clients["polite"], url, bodies(1, polite_count), polite_rps,
                                             duration, timeout)
            rows.append(_row("alone", "polite", polite_rps, polite_limit, results, wall))
            outcome: dict[str, tuple[list[RequestResult], float]] = {}

            async def run(name: str, rate: float, seed: int) -> None:
                count = int(rate * duration) + 1
                outcome[name] = await _open_loop(clients[name], url, bodies(seed, count), rate, duration, timeout)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "polite", polite_rps, 2)
                nursery.start_soon(run, "noisy", noisy_rps, 3)
            for name, rate in (("polite", polite_rps), ("noisy", noisy_rps)):
                rows.append(_row("with flood", name, rate, limits[name], *outcome[name]))
    finally:
        for client in clients.values():
            await client.aclose()
    return rows


def _row(phase: str, tenant: str, rate: float, limit: float, results: list[RequestResult], wall: float) -> TenantRow:
    return TenantRow(phase, tenant, rate, limit, summarize(results, wall), sum(1 for r in results if r.status == 429))


def format_tenants(rows: list[TenantRow]) -> str:
    head = (f"{'phase':<10} {'tenant':<7} {'offered/s':>9} {'limit/s':>7} {'sent':>5} {'served':>6} "
            f"{'served %':>8} {'429':>5} {'other err':>9} {'ttft p50 ms':>11} {'ttft p95 ms':>11}")
    lines = [head, "-" * len(head)]
    for row in rows:
        s = row.summary
        served = s.requests - s.errors
        lines.append(
            f"{row.phase:<10} {row.tenant:<7} {row.offered_rps:>9.1f} {row.limit_rps:>7.1f} {s.requests:>5} "
            f"{served:>6} {100 * served / s.requests if s.requests else 0:>8.1f} {row.limited:>5} "
            f"{s.errors - row.limited:>9} {s.ttft_p50 * 1000:>11.1f} {s.ttft_p95 * 1000:>11.1f}")
    alone = next((r for r in rows if (r.phase, r.tenant) == ("alone", "polite")), None)
    flood = next((r for r in rows if (r.phase, r.tenant) == ("with flood", "polite")), None)
    if alone and flood and alone.summary.ttft_p50 > 0:
        ratio = flood.summary.ttft_p50 / alone.summary.ttft_p50
        lines.append(f"polite TTFT p50 with the flood / alone: x{ratio:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``kvmesh bench tenants [--polite-rps 4] [--noisy-rps 150] [--duration S] ...``."""
    p = argparse.ArgumentParser(prog="kvmesh bench tenants", description=__doc__)
    p.add_argument("--polite-rps", type=float, default=4.0, help="the polite tenant's open-loop rate")
    p.add_argument("--polite-limit", type=float, default=8.0, help="its requests_per_second limit")
    p.add_argument("--noisy-rps", type=float, default=150.0, help="the flood's open-loop rate")
    p.add_argument("--noisy-limit", type=float, default=5.0, help="the noisy tenant's limit")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--profile", default="a40-qwen1.5b")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--log-dir", type=Path, help="child process logs (default: a new temporary folder)")
    args = p.parse_args(argv)
    log_dir = log_folder(args.log_dir)
    spec = FleetSpec(args.engines, args.profile, args.time_scale, max_num_seqs=256)
    try:
        rows = trio.run(contention, spec, log_dir, args.polite_rps, args.polite_limit, args.noisy_rps,
                        args.noisy_limit, args.duration, args.prompt_tokens, args.max_tokens)
    except StartFailed as exc:
        print(f"kvmesh bench tenants: {exc}", file=sys.stderr)
        return 2
    print(f"tenants: {args.engines} engines ({args.profile}, time scale {args.time_scale}), "
          f"{args.duration:.0f} s per phase, open loop")
    print(format_tenants(rows))
    return 0
