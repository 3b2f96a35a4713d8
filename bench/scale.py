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
from dataclasses import dataclass, replace
from pathlib import Path

import trio

from bench import ingest_cost
from bench.client import HttpClient
from bench.replica_stats import (
    EngineGauges,
    bucket_quantile,
    machine_cpu_pressure,
    process_cpu,
    process_rss,
    process_run_wait,
    staleness,
    thread_cpu,
)
from bench.scale_fleet import (
    MODEL,
    EngineEndpoints,
    Publishers,
    Replica,
    publisher,
    redis_server,
    replicas,
    sim_engines,
)
from bench.scale_probes import (
    PROBE_TIMEOUT_S,
    Scrapes,
    follow_all,
    probe_all,
    scrape,
    scraped,
    wait_caught_up,
    wait_converged,
    wait_subscribed,
)
from bench.scale_report import (
    Latency,
    ReplicaResult,
    Strain,
    format_ratios,
    format_tables,
    kept_rates,
    moonshot,
    plot,
    verdicts,
)
from bench.stats import percentile
from events.subscriber import SubscriberConfig
from gateway.ingest_worker import COUNTERS_EVERY_S

IDLE_CPU_S = 2.0
QUEUES_PER_ENGINE = 2
"""A replica's sockets per engine that queue event messages: the live SUB and the replay DEALER."""
FILL_STEP_S = 0.5
DEFAULTS = {"replicas": "1,2,3", "rates": "10000,50000", "engines": 16, "cap": 65536, "steady_s": 20.0,
            "burst_s": 10.0, "probe_s": 10.0, "converge_timeout_s": 30.0}
QUICK = {**DEFAULTS, "rates": "10000", "engines": 8, "cap": 16384, "steady_s": 6.0, "burst_s": 5.0, "probe_s": 4.0,
         "converge_timeout_s": 10.0}
"""The full run holds about a million live blocks (the scale of the RSS target); ``--quick`` 131k, at one rate,
with a small fleet and short phases (3-3.5 minutes on two busy cores). Flags given
explicitly win over both tables."""


@dataclass(frozen=True)
class ScaleOptions:
    replicas: list[int]
    rates: list[float]
    engines: int
    cap: int
    encoding: str
    mix: str
    steady_s: float
    burst_s: float
    probe_s: float
    fill_rate: float
    converge_timeout_s: float
    seed: int
    publishers: int = 1
    ingest_process: bool = False


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
    p.add_argument("--mix", choices=["realistic", "chains"], default="realistic",
                   help="realistic: prefills of 1-500 blocks, decode blocks, evictions (bench/event_mix.py); "
                        "chains: 32-block chains")
    p.add_argument("--fill-rate", type=float, default=50_000.0, help="ops/s while filling every engine to its cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--publishers", type=int, default=1,
                   help="publisher processes sharing the engines (one spends ~6.4 us of CPU per block op)")
    p.add_argument("--plot", type=Path, help="PNG path (default: scale.png in the log folder)")
    p.add_argument("--ingest-process", action="store_true",
                   help="replicas ingest in a child process (ingest_process = true); CPU and RSS count it")
    p.add_argument("--quick", action="store_true", help="R=1,2,3 at 10000 ops/s, 8 engines, short phases")


def options(args: argparse.Namespace) -> ScaleOptions:
    base = QUICK if args.quick else DEFAULTS
    values = {key: base[key] if getattr(args, key) is None else getattr(args, key) for key in base}
    return ScaleOptions(
        [int(x) for x in str(values["replicas"]).split(",") if x],
        [float(x) for x in str(values["rates"]).split(",") if x],
        int(values["engines"]), int(values["cap"]), args.encoding, args.mix, float(values["steady_s"]),
        float(values["burst_s"]), float(values["probe_s"]), args.fill_rate, float(values["converge_timeout_s"]),
        args.seed, max(1, args.publishers), args.ingest_process,
    )  # fmt: skip


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
    pub_args = ["--cap", str(opts.cap), "--model", MODEL, "--encoding", opts.encoding, "--seed", str(opts.seed),
                "--mix", opts.mix]
    async with publisher(pub_args, log_dir, opts.engines, opts.publishers) as (pub, endpoints):
        engines = [EngineEndpoints(f"e{i}", url, ep["events"], ep["replay"], ep["topic"])
                   for i, (url, ep) in enumerate(zip(engine_urls, endpoints, strict=True))]
        ids = [e.id for e in engines]
        cluster = f"scale-{os.getpid()}-r{count}-{rate:.0f}"
        async with replicas(client, count, engines, MODEL, redis_url, cluster, log_dir,
                            opts.ingest_process) as reps:
            await wait_subscribed(client, reps, ids)
            return await _phases(client, opts, pub, reps, ids, count, rate)


@dataclass
class _Window:
    """One publishing window: the publisher's answer; per replica the CPU seconds it used and the block ops
    it applied (read together before and after), its scrapes and, if probed, chat and /ready latency."""

    answer: dict
    cpu_s: list[float]
    applied_ops: list[int]
    scrapes: list[Scrapes]
    latency: list[tuple[Latency, Latency]]
    strain: list[Strain]
    ingest_s: list[dict[str, float]]
    """Per replica, the growth of its ingest seconds by step over the window."""
    threads_s: list[dict[str, float]]
    """Per replica, the CPU seconds its threads used over the window, by kind (``thread_cpu``)."""
    rss_at_end: list[int]
    """Per replica, RSS as the window ended: with its queues as full as the window left them."""


@dataclass
class _Reading:
    """One replica's counters read together: CPU and run-queue wait (``/proc``), block ops applied and its
    loop-lag histogram (``/metrics``), and the machine's CPU pressure."""

    at: float
    cpu_s: float
    run_wait_s: float
    block_ops: int
    loop_lag: dict[float, float]
    pressure_s: float
    ingest_s: dict[str, float]
    threads_s: dict[str, float]
    rss: int


async def _readings(client: HttpClient, reps: list[Replica]) -> list[_Reading]:
    out = []
    for replica in reps:
        gauges = (await scrape(client, replica, timeout=PROBE_TIMEOUT_S))[1]
        out.append(_Reading(time.monotonic(), process_cpu(replica.pid), process_run_wait(replica.pid),
                            gauges.block_ops, gauges.loop_lag, machine_cpu_pressure(), gauges.ingest_s,
                            thread_cpu(replica.pid), process_rss(replica.pid)))
    return out


def _strain(before: list[_Reading], after: list[_Reading]) -> list[Strain]:
    """What kept each replica from answering between two readings (see ``Strain``)."""
    out = []
    for a, b in zip(after, before, strict=True):
        wall = max(a.at - b.at, 1e-9)
        out.append(Strain(1000 * bucket_quantile(b.loop_lag, a.loop_lag, 0.99), (a.run_wait_s - b.run_wait_s) / wall,
                          (a.pressure_s - b.pressure_s) / wall))
    return out


async def _probed(client: HttpClient, reps: list[Replica], seconds: float) -> tuple[list[tuple[Latency, Latency]],
                                                                                       list[Strain]]:
    """Idle chat and /ready latency through every replica, with what strained each meanwhile, scraped as while
    publishing (``scraped``)."""
    before = await _readings(client, reps)
    async with scraped(client, reps):
        latency = await probe_all(client, reps, seconds)
    return latency, _strain(before, await _readings(client, reps))


async def _publish(client: HttpClient, pub: Publishers, reps: list[Replica], rate: float, seconds: float,
                   probe: bool, counted_after_s: float = 0.0) -> _Window:
    """Publish at ``rate`` for ``seconds`` while scraping every replica (and probing it, if asked).

    CPU per op is charged to the ops the replica applied in the window, not to those published: a
    replica that falls behind would otherwise look cheaper. ``counted_after_s``: read the ops applied and the
    ingest times that long after the window ends (the rest at its end), for replicas that export them late."""
    scrapes: list[Scrapes] = [[] for _ in reps]
    latency: list[tuple[Latency, Latency]] = []

    async def probes() -> None:
        latency.extend(await probe_all(client, reps, seconds))

    await pub.command(f"prepare {rate} {seconds}")  # generated before the window: the publisher only sends in it
    before = await _readings(client, reps)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow_all, client, reps, scrapes)
        async with trio.open_nursery() as publishing:
            if probe:
                publishing.start_soon(probes)
            answer = await pub.command(f"run {rate} {seconds}")
        nursery.cancel_scope.cancel()
    after = await _readings(client, reps)
    if counted_after_s:
        await trio.sleep(counted_after_s)
        counted = await _readings(client, reps)
        after = [replace(a, block_ops=c.block_ops, ingest_s=c.ingest_s) for a, c in zip(after, counted, strict=True)]
    pairs = list(zip(after, before, strict=True))
    return _Window(answer, [a.cpu_s - b.cpu_s for a, b in pairs], [a.block_ops - b.block_ops for a, b in pairs],
                   scrapes, latency, _strain(before, after),
                   [{step: s - b.ingest_s.get(step, 0.0) for step, s in a.ingest_s.items()} for a, b in pairs],
                   [{kind: max(0.0, s - b.threads_s.get(kind, 0.0)) for kind, s in a.threads_s.items()}
                    for a, b in pairs],
                   [a.rss for a in after])


async def _fill(client: HttpClient, pub: Publishers, reps: list[Replica], rate: float,
                timeline: dict[str, list[float]], seen: list[Scrapes]) -> None:
    """Every engine to its cap, in short steps each followed by a wait until every replica caught up.

    Filled in one go faster than the replicas ingest, the backlog queued in ZMQ left RSS high for good:
    131k blocks measured 360 B per block after a 50k ops/s fill and 126 B after a 5k ops/s one. The
    steps keep the backlog small, so RSS per block is the index's, not the fill's."""
    while True:
        answer = await pub.command(f"fill {rate} {FILL_STEP_S}")
        _extend(timeline, answer)
        await wait_caught_up(client, reps, timeline, seen)
        if answer["full"]:
            return


FORWARDED_COUNTS_S = COUNTERS_EVERY_S + 0.25
"""With ``ingest_process`` the serving side exports the ingest process's block ops and ingest times as their growth
is noted, once every ``COUNTERS_EVERY_S``: read at the steady window's end they missed up to that much of it (95.5% of
a 75k ops/s window read as applied by a replica that kept up). Read this long after, when the publisher is quiet,
they count what was applied by the window's end, and only a backlog left behind besides."""


def queued_bytes_bound(engines: int, answer: dict) -> float:
    """What a replica's event queues may hold at most, at the mean message size a publishing window sent: each
    engine's live and replay sockets keep ``SubscriberConfig.rcvhwm`` messages each (``events/subscriber.py``)."""
    messages = sum(len(times) for times in answer["times"])
    mean_bytes = answer["bytes"] / messages if messages else 0.0
    return engines * QUEUES_PER_ENGINE * SubscriberConfig().rcvhwm * mean_bytes


async def _idle_cpu(client: HttpClient, reps: list[Replica]) -> list[float]:
    """Cores each replica uses doing nothing but its background polls and gossip, scraped as in the windows it is
    set against (``scraped``)."""
    cpu = [process_cpu(r.pid) for r in reps]
    async with scraped(client, reps):
        await trio.sleep(IDLE_CPU_S)
    return [(process_cpu(r.pid) - c) / IDLE_CPU_S for r, c in zip(reps, cpu, strict=True)]


async def _phases(client: HttpClient, opts: ScaleOptions, pub: Publishers, reps: list[Replica], ids: list[str],
                  count: int, rate: float) -> list[ReplicaResult]:
    seen: list[Scrapes] = [[] for _ in reps]
    timeline: dict[str, list[float]] = {e: [] for e in ids}
    idle_cores = await _idle_cpu(client, reps)
    idle, idle_strain = await _probed(client, reps, opts.probe_s)
    rss_idle = [process_rss(r.pid) for r in reps]  # after serving warmed up, so only the index is counted
    await _fill(client, pub, reps, opts.fill_rate, timeline, seen)

    steady = await _publish(client, pub, reps, rate, opts.steady_s, probe=False,
                            counted_after_s=FORWARDED_COUNTS_S if opts.ingest_process else 0.0)
    _extend(timeline, steady.answer)
    rss_end = [process_rss(r.pid) for r in reps]
    live = [sum((await scrape(client, r))[1].blocks.values()) for r in reps]
    burst = await _publish(client, pub, reps, 2 * rate, opts.burst_s, probe=True)
    stopped = time.monotonic()
    _extend(timeline, burst.answer)
    state = await pub.command("state")
    converged: list[tuple[bool, float]] = [(False, math.inf)] * len(reps)

    async def converge(i: int) -> None:
        converged[i] = await wait_converged(client, reps[i], state, ids, stopped, opts.converge_timeout_s, seen[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(reps)):
            nursery.start_soon(converge, i)
    rss_after_burst = [process_rss(r.pid) for r in reps]
    queue_bound = queued_bytes_bound(len(ids), burst.answer)
    results = []
    for i in range(len(reps)):
        ops = steady.applied_ops[i]
        everything = seen[i] + steady.scrapes[i] + burst.scrapes[i]
        latest = max(everything, key=lambda scrape: scrape[0], default=(0.0, EngineGauges()))[1]
        results.append(ReplicaResult(
            count, rate, i, steady.answer["ops_per_s"], burst.answer["ops_per_s"], ops / steady.answer["seconds"],
            1e6 * steady.cpu_s[i] / ops if ops else math.nan, idle_cores[i], rss_idle[i], rss_end[i], live[i],
            rss_after_burst[i],
            _lag_ms(steady.scrapes[i], timeline, 50), _lag_ms(steady.scrapes[i], timeline, 99),
            _lag_ms(burst.scrapes[i], timeline, 99), converged[i][0], converged[i][1],
            max((g.unhealthy for _, g in everything), default=0),
            latest.replays, latest.dropped, latest.deferred_s,
            idle[i][0], burst.latency[i][0], idle[i][1], burst.latency[i][1], idle_strain[i], burst.strain[i],
            {step: 1e6 * s / ops for step, s in steady.ingest_s[i].items()} if ops and any(steady.ingest_s[i].values())
            else {},  # none: its ingest ran in a process of its own, whose times this process does not export
            burst.applied_ops[i] / burst.answer["seconds"],
            {kind: 1e6 * s / ops for kind, s in steady.threads_s[i].items()} if ops else {},
            burst.rss_at_end[i] - rss_end[i], queue_bound,
        ))  # fmt: skip
    return results


async def sweep(opts: ScaleOptions, log_dir: Path) -> list[ReplicaResult]:
    client = HttpClient()
    results: list[ReplicaResult] = []
    try:
        async with (
            redis_server(log_dir) as redis_url,
            sim_engines(client, opts.engines, log_dir, opts.cap + 1) as engine_urls,
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
    shape = "the realistic mix (bench/event_mix.py)" if opts.mix == "realistic" else "chains of 32x16 tokens"
    print(f"kvmesh bench scale: {opts.engines} engines, cap {opts.cap} blocks each "
          f"({opts.engines * opts.cap:,} live), {shape}, {opts.encoding} encoding; "
          f"steady {opts.steady_s:.0f} s, burst {opts.burst_s:.0f} s; {os.cpu_count()} cores, "
          f"load average {load[0]:.2f} at start")
    if opts.mix == "realistic":
        print(ingest_cost.measure(opts.engines, min(opts.cap, 20_000), 50, opts.seed).line(), flush=True)
    results = trio.run(sweep, opts, log_dir)
    print(format_tables(results))
    print()
    print(format_ratios(results))
    print(moonshot(results))
    print("\n".join(kept_rates(results)))
    png = plot(results, args.plot or log_dir / "scale.png")
    print(f"plot: {png}" if png else "plot: skipped (matplotlib is not installed: pip install -e '.[dev]')")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    judged = verdicts(results)
    for verdict in judged:
        print(verdict.line())
    (log_dir / "scale.json").write_text(json.dumps([vars(r) | {"bytes_per_block": r.bytes_per_block}
                                                     for r in results], default=vars))
    return 1 if any(not v.passed for v in judged) else 0
