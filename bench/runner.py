"""Policy comparisons: a fresh simulated fleet and router per policy, measured back to back.

Every (concurrency, policy) pair gets new engines, so no policy inherits another's warm cache, and
the policies of one concurrency run one after the other on the same noisy machine.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import trio

from bench import engine_stats, peers, run_cpu, workloads
from bench.client import (
    ROUTE_HEADER,
    TRANSPORT_ERRORS,
    Balancer,
    HttpClient,
    model_name,
    run_closed_loop,
    run_sessions,
)
from bench.cost_floor import perfect_cache_ttft
from bench.offline_bound import Fleet, TraceRequest, offline_bound
from bench.prefix import PrefixMeter
from bench.processes import StartFailed, free_port_range, free_udp_port, python_module, spawned, wait_ready
from bench.report import Row
from bench.revision import exported, split_peer
from bench.stats import RequestResult, late_hit_rate, percentile, shares, summarize
from bench.workloads import Conversation, total_requests
from sim.profiles import get_profile
from tokenization.registry import DEFAULT_TOKENIZER_DIR, load_tokenizer
from tokenization.render import prompt_token_ids_sync

PRIMED_WORKLOADS = ("a",)
RUN_SEED_STRIDE = 1000
BOUNDED_WORKLOADS = ("e",)
"""Workloads whose rows carry the offline planner's bound (bench/offline_bound.py)."""
MESHED_POLICIES = ("kv_aware",)
"""Policies whose replicas share one index through the mesh; the others keep per-replica state, as a
peer router's replicas would."""
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
    max_tokens: int | None = None
    timeout: float = 120.0
    warmup: int = 6
    route_header: str = ROUTE_HEADER
    block_size: int = 16
    """The engines' KV block size, for judging request-level hits (a simulated fleet's own wins)."""
    tokenizer: str | None = None
    """The engines' tokenizer, for counting shared prefixes (default: the embedded one the sims use)."""


@asynccontextmanager
async def sim_fleet(client: HttpClient, spec: FleetSpec, log_dir: Path,
                    pids: dict[str, int] | None = None) -> AsyncIterator[list[str]]:
    """Start ``spec.engines`` simulated engines; yields their base URLs (and notes the one process's pid in
    ``pids`` under each URL, for a caller that reads the engines' CPU time)."""
    base = free_port_range(spec.engines, SIM_PORT_OFFSETS)
    log = log_dir / f"sim-{base}.log"
    async with spawned(python_module("sim.cli", *spec.argv(base)), log) as proc:
        urls = [f"http://127.0.0.1:{base + i}" for i in range(spec.engines)]
        for url in urls:
            await wait_ready(client, url + "/health", proc, log)
        if pids is not None:
            pids.update(dict.fromkeys(urls, proc.pid))
        yield urls


@asynccontextmanager
async def router(
    client: HttpClient,
    engine_urls: list[str],
    policy: str,
    log_dir: Path,
    tokenizer: str | None = None,
    extra_args: Sequence[str] = (),
    pids: dict[str, int] | None = None,
    cores: frozenset[int] | None = None,
    root: Path | None = None,
) -> AsyncIterator[str]:
    """Start one kvmesh router with ``policy`` in front of the engines (on ``cores`` when given; the code of
    ``root``, another revision's tree, when given); yields its base URL (and notes its pid in ``pids``, by URL,
    for a caller that reads its CPU time)."""
    port = free_port_range(1)
    args = ["router", "--host", "127.0.0.1", "--port", str(port), "--policy", policy, *extra_args]
    for url in engine_urls:
        args += ["--engine", url]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    log = log_dir / f"router-{policy}-{port}.log"
    async with spawned(python_module("gateway.cli", *args), log, cores=cores, root=root) as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_ready(client, url + "/health", proc, log)
        if pids is not None:
            pids[url] = proc.pid
        yield url


def _mesh_args(log_dir: Path, count: int) -> list[list[str]]:
    """Flags that mesh ``count`` replicas on loopback: gossip ports, each other as seeds, one secret."""
    secret = log_dir / f"mesh-{os.getpid()}-{free_udp_port()}.secret"
    secret.write_text(os.urandom(24).hex())
    ports = [free_udp_port() for _ in range(count)]
    return [
        ["--mesh-bind", f"127.0.0.1:{port}", "--mesh-secret-file", str(secret),
         "--seeds", ",".join(f"127.0.0.1:{p}" for p in ports if p != port)]
        for port in ports
    ]  # fmt: skip


async def wait_meshed(client: HttpClient, urls: list[str], timeout: float = 30.0) -> None:
    """Wait until every replica's membership lists all of them."""
    with trio.move_on_after(timeout):
        while True:
            try:
                views = [await client.get_json(u + "/admin/mesh") for u in urls]
                if all(len(v["members"]) == len(urls) for v in views):  # type: ignore[index]
                    return
            except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError, KeyError, TypeError):
                pass
            await trio.sleep(0.2)
    raise StartFailed(f"router replicas {urls} did not see each other within {timeout:.0f} s")


@asynccontextmanager
async def routers(
    client: HttpClient, engine_urls: list[str], policy: str, count: int, log_dir: Path, tokenizer: str | None = None,
    pids: dict[str, int] | None = None,
) -> AsyncIterator[list[str]]:
    """``count`` router replicas with ``policy``; meshed when the policy shares an index (see
    ``MESHED_POLICIES``), independent otherwise; a peer router for ``smg:POLICY`` (bench/peers.py); kvmesh's
    code at git revision REV for ``POLICY@REV`` (bench/revision.py: a change's before and after in one run).
    Yields their base URLs (and notes each router's pid in ``pids``, by URL)."""
    base, revision = split_peer(policy)
    root = exported(revision, log_dir) if revision else None
    meshed = count > 1 and base in MESHED_POLICIES
    if peers.is_peer(policy):
        starts = [peers.smg_router(client, engine_urls, policy, log_dir, pids) for _ in range(count)]
    else:
        extra = _mesh_args(log_dir, count) if meshed else [[] for _ in range(count)]
        starts = [router(client, engine_urls, base, log_dir, tokenizer, args, pids, root=root) for args in extra]
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(start) for start in starts]
        if meshed:
            await wait_meshed(client, urls)
        yield urls


def engine_of(route: str) -> str:
    """The engine named by a route header: its first field (``host:port`` or an engine id)."""
    return route.replace(",", ";").split(";")[0].strip().removeprefix("engine=")


def ttft_floor(spec: FleetSpec, prompt_tokens: list[int]) -> float:
    """Median TTFT the fleet's cost model gives these prompts if each found all its full blocks cached
    on an idle engine: no routing policy can do better on this workload."""
    profile = get_profile(spec.profile)
    return percentile([perfect_cache_ttft(profile, p, spec.block_size, spec.time_scale) for p in prompt_tokens], 50)


def trace_of(results: list[RequestResult], conversations: list[Conversation], tokenizer, model: str) -> list[
        TraceRequest]:
    """The requests in the order they were sent, as the engines tokenized them, keyed by shared prefix."""
    by_key = {c.key: c for c in conversations}
    trace = []
    for result in sorted(results, key=lambda r: r.started):
        conv = by_key.get(result.key)
        if conv is None:
            continue
        messages = conv.prefix_messages(result.turn) + [{"role": "user", "content": conv.user_turns[result.turn]}]
        ids = prompt_token_ids_sync(tokenizer, {"model": model, "messages": messages}, "chat")
        session = conv.key if len(conv.user_turns) > 1 else ""
        trace.append(TraceRequest(conv.system or conv.key, tuple(ids), conv.max_tokens, session))
    return trace


def bound_for(spec: FleetSpec, concurrency: int, trace: list[TraceRequest]):
    """The offline planner's bound for this trace on this fleet (bench/offline_bound.py)."""
    fleet = Fleet(spec.engines, spec.num_blocks, spec.block_size, get_profile(spec.profile), spec.time_scale,
                  concurrency, spec.max_num_seqs)
    return offline_bound(trace, fleet)


def write_requests(path: Path, results: list[RequestResult]) -> None:
    """One JSON line per request in the order they were sent: when, how long to the first token and to the
    end, the route header (engine, overlap, estimate and reason of a kvmesh router), the engine's usage."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for r in sorted(results, key=lambda r: r.started):
            out.write(json.dumps({
                "started": round(r.started, 4), "ttft": None if r.ttft is None else round(r.ttft, 4),
                "total": round(r.total, 4), "key": r.key, "turn": r.turn, "route": r.route, "error": r.error,
                "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                "output_tokens": r.output_tokens, "retried": r.retried,
            }) + "\n")


@dataclass(frozen=True)
class Load:
    """How requests are sent: ``concurrency`` clients in a closed loop, or sessions arriving on their own at
    ``arrival_rate`` per second (Poisson, seeded) with ``concurrency`` only describing the expected load."""

    concurrency: int
    arrival_rate: float | None = None
    seed: int = 0


async def measure(
    client: HttpClient,
    label: str,
    url: str | Sequence[str],
    engine_urls: list[str],
    concurrency: int,
    options: MeasureOptions,
    capacity_tokens: int = 0,
    fleet: FleetSpec | None = None,
    run: int = 1,
) -> Row:
    """Warm up, prime if the workload asks for it, then run the named workload (see ``measure_sent``)."""
    convs = workloads.build(options.workload, options.seed, options.requests, capacity_tokens, options.max_tokens)
    primed = workloads.primers(convs, options.seed) if options.workload in PRIMED_WORKLOADS else []
    return await measure_sent(client, label, url, engine_urls, Load(concurrency), convs, options, fleet, run,
                              primed, bounded=options.workload in BOUNDED_WORKLOADS)


async def measure_sent(
    client: HttpClient,
    label: str,
    url: str | Sequence[str],
    engine_urls: list[str],
    load: Load,
    convs: list[Conversation],
    options: MeasureOptions,
    fleet: FleetSpec | None = None,
    run: int = 1,
    primed: Sequence[Conversation] = (),
    bounded: bool = False,
    balancer: Balancer | None = None,
    request_log: Path | None = None,
    router_pids: Sequence[int] = (),
) -> Row:
    """Warm up (and send ``primed`` first), then send ``convs`` between two metric scrapes.

    Several router URLs share the requests in turn (through ``balancer`` when given: one that kills a
    replica partway). With the ``fleet`` that serves them, the row also carries the cost model's
    perfect-cache TTFT for the same prompts, and when ``bounded`` the offline planner's bound for the trace
    as it was sent. ``request_log`` gets one JSON line per request, in the order they were sent. The CPU of
    ``router_pids`` and of the machine is read around the measured requests alone.
    """
    urls = [url] if isinstance(url, str) else list(url)
    model = await model_name(client, urls[0])
    warm = workloads.unique_prompts(options.seed, options.warmup) + list(primed)
    await run_closed_loop(client, urls, warm, max(1, len(engine_urls)), model, True, options.timeout)
    before = await engine_stats.scrape(client, engine_urls, names=engine_stats.RUN_SAMPLES)
    routers_before = await engine_stats.scrape(client, urls, names=engine_stats.ROUTER_COUNTERS)
    cpu_before = run_cpu.mark(router_pids)
    if load.arrival_rate is None:
        results, wall = await run_closed_loop(
            client, balancer or urls, convs, load.concurrency, model, True, options.timeout, options.route_header
        )
    else:
        results, wall = await run_sessions(client, balancer or urls, convs, load.arrival_rate, model,
                                           random.Random(f"arrivals-{load.seed}"), True, options.timeout,
                                           options.route_header)
    cpu_after = run_cpu.mark(router_pids)
    after = await engine_stats.scrape(client, engine_urls, names=engine_stats.RUN_SAMPLES)
    routers_after = await engine_stats.scrape(client, urls, names=engine_stats.ROUTER_COUNTERS)
    deltas = engine_stats.deltas(before, after)
    ids = [urlsplit(u).netloc for u in engine_urls]
    block_size = fleet.block_size if fleet else options.block_size
    tokenizer = load_tokenizer(options.tokenizer or str(DEFAULT_TOKENIZER_DIR))
    PrefixMeter(tokenizer, block_size).assign(results, convs)
    summary = summarize(results, wall)
    if request_log is not None:
        write_requests(request_log, results)
    prompts = [r.prompt_tokens for r in results if r.ok and r.prompt_tokens]
    bound = None
    if fleet and bounded:
        bound = bound_for(fleet, load.concurrency, trace_of(results, convs, tokenizer, model))
    routed: dict[str, float] = {}
    for route, count in summary.routes.items():
        routed[engine_of(route)] = routed.get(engine_of(route), 0) + count
    served = {i: d.get(engine_stats.SUCCESSES, 0.0) for i, d in zip(ids, deltas, strict=True)}
    ttfts = [r.ttft for r in results if r.ok and r.ttft is not None]
    return Row(
        label=label,
        workload=options.workload,
        concurrency=load.concurrency,
        summary=summary,
        hit_rate=engine_stats.fleet_hit_rate(deltas),
        route_share=shares(routed, ids) if routed else [],
        engine_share=shares(served, ids),
        routers=len(urls),
        ttft_floor=ttft_floor(fleet, prompts) if fleet else math.nan,
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        bound_hit_rate=bound.hit_rate if bound else math.nan,
        bound_ttft_p50=bound.ttft_p50 if bound else math.nan,
        run=run,
        decision_ms=engine_stats.mean_decision_ms(engine_stats.deltas(routers_before, routers_after)),
        late_hit_rate=late_hit_rate(results, total_requests(convs) // 2),
        outside_engines_s=statistics.fmean(ttfts) - engine_stats.fleet_engine_ttft(deltas) if ttfts else math.nan,
        router_cpu_s=run_cpu.router_cpu_per_request(cpu_before, cpu_after, len(results)),
        busy_cores=run_cpu.machine_busy_cores(cpu_before, cpu_after),
    )


def _progress(row: Row) -> None:
    s = row.summary
    print(
        f"  {row.workload} c={row.concurrency} {row.label} x{row.routers} run {row.run}: {s.requests} requests, "
        f"{s.errors} errors, {s.req_per_s:.1f} req/s, hit {row.hit_rate:.3f} (requests {s.request_hit_rate:.3f})",
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
    replicas: int = 1,
    runs: int = 1,
) -> list[Row]:
    """One row per (concurrency, policy, run), each policy on a fresh fleet, policies back to back;
    ``replicas`` routers per policy share the requests in turn; ``runs`` consecutive runs on the same
    engines and routers show whether a policy holds up over time: each run has its own seed (new text on
    caches full of the last run's), so every run pays the same first misses and is judged against its
    own bound."""
    client = HttpClient()
    rows = []
    try:
        for concurrency in concurrencies:
            for policy in policies:
                async with (
                    sim_fleet(client, spec, log_dir) as engines,
                    routers(client, engines, policy, replicas, log_dir, tokenizer) as urls,
                ):
                    for run in range(1, runs + 1):
                        fresh = replace(options, seed=options.seed + RUN_SEED_STRIDE * (run - 1))
                        row = await measure(
                            client, policy, urls, engines, concurrency, fresh, spec.capacity_tokens, spec, run
                        )
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
            fresh = replace(options, seed=options.seed + RUN_SEED_STRIDE * i)
            row = await measure(client, label, url, engine_metrics, concurrency, fresh, capacity_tokens)
            rows.append(row)
            _progress(row)
    finally:
        await client.aclose()
    return rows
