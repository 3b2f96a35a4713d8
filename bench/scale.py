"""``kvmesh bench scale``: is a replica's cost per block op flat in the number of replicas, and does serving
hold up while it ingests?

For each rate and replica count R, on a fresh synthetic publisher (bench/synthetic_publisher.py) and R
fresh meshed replicas (bench/scale_fleet.py), with simulated engines answering chat and health:

1. idle: CPU of each replica, latency of chat and ``/ready`` through it, then its RSS; ``fill``: every
   engine stores chains up to its cap, until every replica applied every batch;
2. steady: the rate for ``--steady-s`` (stores and evictions): CPU per block op from /proc, RSS per live
   block, replication lag from ``/metrics`` scrapes;
3. burst: twice the rate for ``--burst-s`` with chat and ``/ready`` probes through every replica;
4. the publisher stops: time until each replica's per-engine digests (``GET /admin/index``) equal the
   publisher's live sets.

Every scrape also reads ``kvmesh_engine_healthy``: an engine marked down by a late router shows there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.client import TRANSPORT_ERRORS, HttpClient, completion
from bench.replica_stats import EngineGauges, engine_gauges, process_cpu, process_rss, staleness
from bench.runner import FleetSpec, sim_fleet
from bench.scale_fleet import EngineEndpoints, Publisher, Replica, publisher, redis_server, replicas
from bench.scale_report import Latency, ReplicaResult, format_ratios, format_tables, moonshot, plot, verdicts
from bench.stats import percentile

MODEL = "kvmesh-tiny"
"""The simulated engines' served model: the routers key every engine's blocks under it."""
POLL_S = 0.5
"""Scrape interval of each replica's /metrics while measuring: a scrape costs the replica a few ms."""
CONVERGE_POLL_S = 0.2
SETTLE_S = 1.0
IDLE_CPU_S = 2.0
CHAT_WORKERS = 2
READY_INTERVAL_S = 0.02
PROBE_TIMEOUT_S = 30.0
CATCH_UP_TIMEOUT_S = 120.0
DEFAULTS = {"replicas": "1,2,3", "rates": "10000,50000", "engines": 16, "cap": 65536, "steady_s": 20.0,
            "burst_s": 10.0, "probe_s": 10.0, "converge_timeout_s": 30.0}
QUICK = {**DEFAULTS, "rates": "10000", "engines": 8, "cap": 16384, "steady_s": 6.0, "burst_s": 5.0, "probe_s": 4.0,
         "converge_timeout_s": 15.0}
"""The full run holds about a million live blocks (the issue's RSS target); ``--quick`` 131k, at one rate,
with a small fleet and short phases (about 3 minutes on two busy cores). Flags given
explicitly win over both tables."""

Scrapes = list[tuple[float, EngineGauges]]


@dataclass(frozen=True)
class ScaleOptions:
    replicas: list[int]
    rates: list[float]
    engines: int
    cap: int
    encoding: str
    steady_s: float
    burst_s: float
    probe_s: float
    fill_rate: float
    converge_timeout_s: float
    seed: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", help=f"comma-separated replica counts (default {DEFAULTS['replicas']})")
    p.add_argument("--rates", help=f"comma-separated total block-op rates, ops/s (default {DEFAULTS['rates']})")
    p.add_argument("--engines", type=int, help=f"default {DEFAULTS['engines']}")
    p.add_argument("--cap", type=int, help=f"live blocks per engine before evictions start (default {DEFAULTS['cap']})")
    p.add_argument("--steady-s", type=float, help=f"seconds at the rate (default {DEFAULTS['steady_s']:.0f})")
    p.add_argument("--burst-s", type=float, help=f"seconds at twice the rate (default {DEFAULTS['burst_s']:.0f})")
    p.add_argument("--probe-s", type=float, help=f"seconds of idle latency probes (default {DEFAULTS['probe_s']:.0f})")
    p.add_argument("--converge-timeout-s", type=float, help=f"default {DEFAULTS['converge_timeout_s']:.0f}")
    p.add_argument("--encoding", choices=["map", "array"], default="map", help="vLLM's event encoding")
    p.add_argument("--fill-rate", type=float, default=50_000.0, help="ops/s while filling every engine to its cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, help="PNG path (default: scale.png in the log folder)")
    p.add_argument("--quick", action="store_true", help="R=1,2,3 at 10000 ops/s, 8 engines, short phases")


def options(args: argparse.Namespace) -> ScaleOptions:
    base = QUICK if args.quick else DEFAULTS
    values = {key: base[key] if getattr(args, key) is None else getattr(args, key) for key in base}
    return ScaleOptions(
        [int(x) for x in str(values["replicas"]).split(",") if x],
        [float(x) for x in str(values["rates"]).split(",") if x],
        int(values["engines"]), int(values["cap"]), args.encoding, float(values["steady_s"]),
        float(values["burst_s"]), float(values["probe_s"]), args.fill_rate, float(values["converge_timeout_s"]),
        args.seed,
    )  # fmt: skip


async def _scrape(client: HttpClient, replica: Replica) -> tuple[float, EngineGauges]:
    with trio.fail_after(5):
        response = await client.request(replica.url + "/metrics")
    return time.monotonic(), engine_gauges(response.body.decode())


async def _follow(client: HttpClient, replica: Replica, into: Scrapes) -> None:
    """Scrape ``/metrics`` every POLL_S until cancelled; a scrape that fails is skipped."""
    while True:
        try:
            into.append(await _scrape(client, replica))
        except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
            pass
        await trio.sleep(POLL_S)


async def _follow_all(client: HttpClient, reps: list[Replica], scrapes: list[Scrapes]) -> None:
    async with trio.open_nursery() as nursery:
        for replica, into in zip(reps, scrapes, strict=True):
            nursery.start_soon(_follow, client, replica, into)


async def _probe(client: HttpClient, url: str, seconds: float) -> tuple[Latency, Latency]:
    """Chat (one token, CHAT_WORKERS at a time) and ``/ready`` latency through one replica for ``seconds``."""
    until = time.monotonic() + seconds
    chats: list[float] = []
    readies: list[float] = []
    errors = {"chat": 0, "ready": 0}

    async def chat_worker(worker: int) -> None:
        n = 0
        while time.monotonic() < until:
            body = {"model": MODEL, "max_tokens": 1,
                    "messages": [{"role": "user", "content": f"scale probe {worker}-{n}: say hi"}]}
            result = await completion(client, url + "/v1/chat/completions", body, timeout=PROBE_TIMEOUT_S)
            if result.ok:
                chats.append(result.total)
            else:
                errors["chat"] += 1
            n += 1

    async def ready_worker() -> None:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                with trio.fail_after(PROBE_TIMEOUT_S):
                    ok = (await client.request(url + "/ready")).status == 200
            except (*TRANSPORT_ERRORS, trio.TooSlowError):
                ok = False
            if ok:
                readies.append(time.monotonic() - started)
            else:
                errors["ready"] += 1
            await trio.sleep(READY_INTERVAL_S)

    async with trio.open_nursery() as nursery:
        for worker in range(CHAT_WORKERS):
            nursery.start_soon(chat_worker, worker)
        nursery.start_soon(ready_worker)
    return Latency.of(chats, errors["chat"]), Latency.of(readies, errors["ready"])


async def _probe_all(client: HttpClient, reps: list[Replica], seconds: float) -> list[tuple[Latency, Latency]]:
    out: list[tuple[Latency, Latency]] = [(Latency(), Latency())] * len(reps)

    async def one(i: int) -> None:
        out[i] = await _probe(client, reps[i].url, seconds)

    async with trio.open_nursery() as nursery:
        for i in range(len(reps)):
            nursery.start_soon(one, i)
    return out


async def _wait_subscribed(client: HttpClient, reps: list[Replica], ids: list[str]) -> None:
    """Until every replica lists every engine as fed by events (then ZMQ gets a moment to connect)."""
    for replica in reps:
        with trio.fail_after(60):
            while True:
                try:
                    report = await client.get_json(replica.url + "/admin/index")
                except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
                    report = {}
                engines = report.get("engines", {}) if isinstance(report, dict) else {}
                if all(engines.get(i, {}).get("has_events") for i in ids):
                    break
                await trio.sleep(0.2)
    await trio.sleep(SETTLE_S)


async def _wait_caught_up(client: HttpClient, reps: list[Replica], timeline: dict[str, list[float]],
                          scrapes: list[Scrapes]) -> None:
    """Until every replica applied every published batch (bounded; a replica that never does shows in the
    table as lag and as a failed convergence)."""
    with trio.move_on_after(CATCH_UP_TIMEOUT_S):
        for replica, into in zip(reps, scrapes, strict=True):
            while True:
                try:
                    into.append(await _scrape(client, replica))
                    if all(into[-1][1].batches.get(e, 0) >= len(t) for e, t in timeline.items()):
                        break
                except (*TRANSPORT_ERRORS, trio.TooSlowError):
                    pass
                await trio.sleep(POLL_S)
        return
    print(f"  not every replica caught up within {CATCH_UP_TIMEOUT_S:.0f} s", file=sys.stderr, flush=True)


async def _converge(client: HttpClient, replica: Replica, state: dict, ids: list[str], stopped: float,
                    timeout: float, into: Scrapes) -> tuple[bool, float]:
    """Whether the replica's per-engine digests equal the publisher's, and seconds after ``stopped`` until
    they did (inf when they never did within ``timeout``)."""
    blocks = {e: s["blocks"] for e, s in zip(ids, state["engines"], strict=True)}
    digests = {e: s["digest"] for e, s in zip(ids, state["engines"], strict=True)}

    async def equal() -> bool:
        report = await client.get_json(replica.url + "/admin/index", timeout=PROBE_TIMEOUT_S)
        engines = report.get("engines", {}) if isinstance(report, dict) else {}
        return all(engines.get(e, {}).get("digest") == d for e, d in digests.items())

    while time.monotonic() < stopped + timeout:
        try:
            into.append(await _scrape(client, replica))
            if into[-1][1].blocks == blocks and await equal():
                return True, time.monotonic() - stopped
        except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
            pass
        await trio.sleep(CONVERGE_POLL_S)
    try:
        return await equal(), math.inf
    except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
        return False, math.inf


def _extend(timeline: dict[str, list[float]], answer: dict) -> None:
    for (engine, times), first in zip(timeline.items(), answer["first_seq"], strict=True):
        if first != len(times):
            raise RuntimeError(f"publisher seq {first} of {engine} does not follow the {len(times)} batches seen")
    for times, new in zip(timeline.values(), answer["times"], strict=True):
        times.extend(new)


def _lag_ms(scrapes: Scrapes, timeline: dict[str, list[float]], q: float) -> float:
    samples = [lag for at, gauges in scrapes for lag in staleness(at, gauges.batches, timeline)]
    return 1000 * percentile(samples, q)


async def measure_cell(client: HttpClient, opts: ScaleOptions, count: int, rate: float, engine_urls: list[str],
                       redis_url: str, log_dir: Path) -> list[ReplicaResult]:
    """One (R, rate) cell on a fresh publisher and fresh replicas; one result per replica."""
    pub_args = ["--engines", str(opts.engines), "--cap", str(opts.cap), "--model", MODEL,
                "--encoding", opts.encoding, "--seed", str(opts.seed)]
    async with publisher(pub_args, log_dir) as (pub, endpoints):
        engines = [EngineEndpoints(f"e{i}", url, ep["events"], ep["replay"], ep["topic"])
                   for i, (url, ep) in enumerate(zip(engine_urls, endpoints, strict=True))]
        ids = [e.id for e in engines]
        cluster = f"scale-{os.getpid()}-r{count}-{rate:.0f}"
        async with replicas(client, count, engines, MODEL, redis_url, cluster, log_dir) as reps:
            await _wait_subscribed(client, reps, ids)
            return await _phases(client, opts, pub, reps, ids, count, rate)


async def _phases(client: HttpClient, opts: ScaleOptions, pub: Publisher, reps: list[Replica], ids: list[str],
                  count: int, rate: float) -> list[ReplicaResult]:
    seen: list[Scrapes] = [[] for _ in reps]
    timeline: dict[str, list[float]] = {e: [] for e in ids}
    cpu = [process_cpu(r.pid) for r in reps]
    await trio.sleep(IDLE_CPU_S)
    idle_cores = [(process_cpu(r.pid) - c) / IDLE_CPU_S for r, c in zip(reps, cpu, strict=True)]
    idle = await _probe_all(client, reps, opts.probe_s)
    rss_idle = [process_rss(r.pid) for r in reps]  # after serving warmed up, so only the index is counted
    _extend(timeline, await pub.command(f"fill {opts.fill_rate}"))
    await _wait_caught_up(client, reps, timeline, seen)

    steady_scrapes: list[Scrapes] = [[] for _ in reps]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_follow_all, client, reps, steady_scrapes)
        cpu = [process_cpu(r.pid) for r in reps]
        steady = await pub.command(f"run {rate} {opts.steady_s}")
        cpu = [process_cpu(r.pid) - c for r, c in zip(reps, cpu, strict=True)]
        nursery.cancel_scope.cancel()
    _extend(timeline, steady)
    rss_end = [process_rss(r.pid) for r in reps]
    live = [sum((await _scrape(client, r))[1].blocks.values()) for r in reps]

    burst_scrapes: list[Scrapes] = [[] for _ in reps]
    busy: list[tuple[Latency, Latency]] = []

    async def probe_burst() -> None:
        busy.extend(await _probe_all(client, reps, opts.burst_s))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_follow_all, client, reps, burst_scrapes)
        async with trio.open_nursery() as probes:
            probes.start_soon(probe_burst)
            burst = await pub.command(f"run {2 * rate} {opts.burst_s}")
        nursery.cancel_scope.cancel()
    stopped = time.monotonic()
    _extend(timeline, burst)
    state = await pub.command("state")
    converged: list[tuple[bool, float]] = [(False, math.inf)] * len(reps)

    async def converge(i: int) -> None:
        converged[i] = await _converge(client, reps[i], state, ids, stopped, opts.converge_timeout_s, seen[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(reps)):
            nursery.start_soon(converge, i)
    results = []
    for i in range(len(reps)):
        everything = seen[i] + steady_scrapes[i] + burst_scrapes[i]
        latest = max(everything, key=lambda scrape: scrape[0], default=(0.0, EngineGauges()))[1]
        results.append(ReplicaResult(
            count, rate, i, steady["ops_per_s"], burst["ops_per_s"],
            1e6 * cpu[i] / steady["ops"] if steady["ops"] else math.nan,
            idle_cores[i], rss_idle[i], rss_end[i], live[i],
            _lag_ms(steady_scrapes[i], timeline, 50), _lag_ms(steady_scrapes[i], timeline, 99),
            _lag_ms(burst_scrapes[i], timeline, 99), converged[i][0], converged[i][1],
            max((g.unhealthy for _, g in everything), default=0),
            latest.replays, latest.dropped, latest.deferred_s,
            idle[i][0], busy[i][0], idle[i][1], busy[i][1],
        ))  # fmt: skip
    return results


async def sweep(opts: ScaleOptions, log_dir: Path) -> list[ReplicaResult]:
    client = HttpClient()
    results: list[ReplicaResult] = []
    try:
        async with (
            redis_server(log_dir) as redis_url,
            sim_fleet(client, FleetSpec(engines=opts.engines, profile="fast"), log_dir) as engine_urls,
        ):
            for rate in opts.rates:
                for count in opts.replicas:
                    started = time.monotonic()
                    results += await measure_cell(client, opts, count, rate, engine_urls, redis_url, log_dir)
                    print(f"scale bench: R={count} at {rate:.0f} ops/s took {time.monotonic() - started:.0f} s",
                          file=sys.stderr, flush=True)
                    await client.aclose()
    finally:
        await client.aclose()
    return results


def run(args: argparse.Namespace, log_dir: Path) -> int:
    """Entry of ``kvmesh bench scale``; exits 1 when a target fails."""
    opts = options(args)
    load = os.getloadavg()
    print(f"kvmesh bench scale: {opts.engines} engines, cap {opts.cap} blocks each "
          f"({opts.engines * opts.cap:,} live), chains of 32x16 tokens, {opts.encoding} encoding; "
          f"steady {opts.steady_s:.0f} s, burst {opts.burst_s:.0f} s; {os.cpu_count()} cores, "
          f"load average {load[0]:.2f} at start")
    results = trio.run(sweep, opts, log_dir)
    print(format_tables(results))
    print()
    print(format_ratios(results))
    print(moonshot(results))
    png = plot(results, args.plot or log_dir / "scale.png")
    print(f"plot: {png}" if png else "plot: skipped (matplotlib is not installed: pip install -e '.[dev]')")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    judged = verdicts(results)
    for verdict in judged:
        print(verdict.line())
    (log_dir / "scale.json").write_text(json.dumps([vars(r) | {"bytes_per_block": r.bytes_per_block}
                                                     for r in results], default=vars))
    return 1 if any(not v.passed for v in judged) else 0
