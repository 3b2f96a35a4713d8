"""``kvmesh bench autoscale``: the autoscaler against two fixed fleets on one traffic ramp.

Three fleets on the same trace (bench/autoscale_trace.py) at the same time, so the machine's load falls on
all three alike, each behind its own router:

- ``autoscaled``: one router whose autoscaler starts and releases engines through the local provider
  (real ``kvmesh sim`` processes), from no engine at all;
- ``fixed-peak`` / ``fixed-average``: a router in front of a fleet sized for the peak and for the average.

Then the lease check: three meshed routers whose autoscaler hands out one standby engine; the holder is
killed and the time until another replica holds the lease is measured, with the provisions counted.

Each run reports engine-seconds (and cost), TTFT p50/p99, failed requests, windows over the TTFT ceiling
and scale events, a PNG plot shows load, engine count and TTFT p99 over time, and verdict lines close.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import trio

from autoscale.offers import Offer
from autoscale.providers.base import ProvisionResult
from autoscale.providers.local import LocalProvider
from bench.autoscale_trace import RunRecord, Trace, TrafficMix, judge
from bench.client import TRANSPORT_ERRORS, HttpClient, completion, model_name
from bench.processes import StartFailed, free_port_range, free_udp_port, python_module, spawned, wait_ready
from bench.replica_stats import machine_cpu_pressure
from bench.stats import RequestResult, percentile

POOL_SCRIPT = Path(__file__).resolve().parents[1] / "autoscale" / "providers" / "examples" / "standby_pool.py"


@dataclass(frozen=True)
class Setup:
    duration_s: float
    peak_rps: float
    window_s: float
    """The trace's "minute": TTFT p99 is judged per window of this many seconds."""
    peak_engines: int
    average_engines: int
    ceiling_s: float = 2.0
    """The SLO on TTFT p99 per window; the autoscaler's own trigger is half of it, to act before a miss."""
    cooldown_s: float = 4.0
    price_per_hour: float = 1.1
    provisioning_s: float = 1.0
    down_stable_s: float = 2.0
    """The offers' provisioning latency, compressed like the trace (the local provider waits it)."""
    max_num_seqs: int = 2
    profile: str = "a40-qwen1.5b"
    seed: int = 0

    def sim_args(self) -> list[str]:
        return ["--profile", self.profile, "--max-num-seqs", str(self.max_num_seqs)]

    def autoscaler_toml(self) -> str:
        return f"""
[autoscaler]
enabled = true
provider = "local"
sim_args = {json.dumps(self.sim_args())}
interval_s = 1.0
min_engines = 1
max_engines = {self.peak_engines}
queue_up = 0.5
queue_drain = 0.2
utilisation_floor = 0.6  # 0.5 kept 5 engines at 50-60% for 7 s of the diurnal fall where 4 met the target
target_utilisation = 0.75
ttft_p99_ceiling_s = {self.ceiling_s / 2}
cooldown_s = {self.cooldown_s}
step_cooldown_s = 1.0
down_stable_s = {self.down_stable_s}
max_step_up = 3
max_step_down = 1
drain_deadline_s = 30.0

[[autoscaler.offers]]
name = "a40-sim"
gpu = "A40"
price_per_hour = {self.price_per_hour}
capacity = {self.max_num_seqs}
provisioning_s = {self.provisioning_s}

[[autoscaler.offers]]
name = "h100-sim"
gpu = "H100"
price_per_hour = {self.price_per_hour * 3}
capacity = {self.max_num_seqs}
provisioning_s = {self.provisioning_s}
"""


QUICK = Setup(duration_s=90, peak_rps=16, window_s=3.0, peak_engines=5, average_engines=2, cooldown_s=6.0,
              down_stable_s=3.0, provisioning_s=1.5)
FULL = Setup(duration_s=600, peak_rps=16, window_s=20.0, peak_engines=5, average_engines=2, cooldown_s=40,
             provisioning_s=10.0, down_stable_s=20.0)


async def drive(client: HttpClient, url: str, setup: Setup, on_tick=None) -> list[RequestResult]:
    """Send the trace's arrivals (open loop) through ``url``, timing each from when it was due; ``on_tick(t)``
    runs every second."""
    model = await model_name(client, url)
    trace = Trace(setup.duration_s, setup.peak_rps)
    mix = TrafficMix(setup.seed)
    results: list[RequestResult] = []
    t0 = trio.current_time()

    async def one(started: float) -> None:
        # the time this process took to send after the arrival was due counts too (a busy client must not
        # hide the wait from the measurement)
        late = trio.current_time() - (t0 + started)
        conversation = mix.next()
        result = await completion(client, url + "/v1/chat/completions", conversation.body(model, True), 60.0,
                                  started=started)
        mix.answered(conversation, result.content)
        result.total += late
        if result.ttft is not None:
            result.ttft += late
        results.append(result)

    async def ticks() -> None:
        while on_tick is not None:
            await on_tick(trio.current_time() - t0)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticks)
        async with trio.open_nursery() as senders:
            for at in trace.arrivals():
                await trio.sleep_until(t0 + at)
                senders.start_soon(one, at)
        nursery.cancel_scope.cancel()
    return results


def _router(log: Path, args: list[str]):
    port = free_port_range(1)
    argv = python_module("gateway.cli", "router", "--host", "127.0.0.1", "--port", str(port),
                         "--metrics-interval", "0.5", *args)
    return port, spawned(argv, log)


def sample_autoscaled(client: HttpClient, url: str, samples: list[tuple[float, float]],
                            decisions: dict[float, dict]):
    """An ``on_tick`` that records the engines paid for (started, draining included, or being provisioned)
    and the decisions."""

    async def sample(t: float) -> None:
        try:
            report = await client.get_json(url + "/admin/autoscaler")
        except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
            return
        # one answer, so an engine turning ready between two requests is not counted twice
        samples.append((t, len(report["managed"]) + len(report["pending"])))  # type: ignore[index]
        for d in report["decisions"]:  # type: ignore[index]
            decisions[d["at"]] = d

    return sample


async def local_engines(nursery: trio.Nursery, sim_args: list[str], count: int) -> list[str]:
    """``count`` engines started by the autoscaler's own local provider, so fixed and autoscaled fleets run
    the same engine processes."""
    provider = LocalProvider(sim_args)
    provider.attach(nursery)
    ready: list[ProvisionResult] = []
    offer = Offer("fixed", provisioning_s=0)
    for _ in range(count):
        provider.provision(offer, ready.append, term=0)
    with trio.fail_after(120):
        while len(ready) < count:
            await trio.sleep(0.05)
    failed = [r.error for r in ready if r.engine is None]
    if failed:
        raise StartFailed(f"local engines did not start: {failed}")
    return [r.engine.url for r in ready if r.engine is not None]


async def run_fleets(client: HttpClient, setup: Setup, log_dir: Path) -> tuple[list[RunRecord], float]:
    """The autoscaled fleet and the two fixed ones, each behind its own router, on the same trace at the same
    time, so the machine's load falls on all three alike; also the share of the trace in which some runnable
    task on the machine waited for a core (NaN where the kernel does not say)."""
    config = log_dir / "autoscaled.toml"
    config.write_text(setup.autoscaler_toml())
    fleets = {"autoscaled": (0, ["--config", str(config)])}
    sizes = {"fixed-peak": setup.peak_engines, "fixed-average": setup.average_engines}
    async with trio.open_nursery() as engines_nursery, AsyncExitStack() as stack:
        urls = await local_engines(engines_nursery, setup.sim_args(), sum(sizes.values()))
        for label, count in sizes.items():
            engines, urls = urls[:count], urls[count:]
            fleets[label] = (count, [a for u in engines for a in ("--engine", u)])
        routers = {}
        for label, (_, args) in fleets.items():
            log = log_dir / f"router-{label}.log"
            port, process = _router(log, args)
            routers[label] = (f"http://127.0.0.1:{port}", await stack.enter_async_context(process), log)
        for url, proc, log in routers.values():
            await wait_ready(client, url + "/ready", proc, log, timeout=120)
        samples: list[tuple[float, float]] = []
        decisions: dict[float, dict] = {}
        results: dict[str, list[RequestResult]] = {}
        started_unix = time.time()
        pressure_before = machine_cpu_pressure()

        async def run(label: str) -> None:
            url = routers[label][0]
            tick = sample_autoscaled(client, url, samples, decisions) if label == "autoscaled" else None
            results[label] = await drive(client, url, setup, tick)

        async with trio.open_nursery() as runs:
            for label in fleets:
                runs.start_soon(run, label)
        pressure = (machine_cpu_pressure() - pressure_before) / (time.time() - started_unix)
        engines_nursery.cancel_scope.cancel()
    auto = RunRecord("autoscaled", results["autoscaled"], samples, setup.price_per_hour, setup.duration_s,
                     sorted(decisions.values(), key=lambda d: d["at"]), started_unix)
    return [auto, *(RunRecord(label, results[label], [(0.0, float(count))], setup.price_per_hour, setup.duration_s)
                    for label, count in sizes.items())], pressure


async def lease_handover(client: HttpClient, log_dir: Path) -> tuple[float | None, int]:
    """Three meshed routers hand out one standby engine; kill the lease holder; time the takeover."""
    async with trio.open_nursery() as engines_nursery:
        urls = await local_engines(engines_nursery, ["--profile", "fast"], 2)
        static, spare = urls[0], urls[1]
        state = log_dir / "standby-pool.json"
        config = log_dir / "lease.toml"
        config.write_text(f"""
[autoscaler]
enabled = true
provider = "command"
command = {json.dumps([sys.executable, str(POOL_SCRIPT), str(state), spare])}
interval_s = 0.5
lease_ttl_s = 3.0
min_engines = 2
max_engines = 2
[[autoscaler.offers]]
name = "standby"
provisioning_s = 0
""")
        secret = log_dir / "lease-mesh.secret"
        secret.write_text(os.urandom(24).hex())
        gossip = [free_udp_port() for _ in range(3)]
        async with AsyncExitStack() as stack:
            routers = []
            for g in gossip:
                seeds = ",".join(f"127.0.0.1:{p}" for p in gossip if p != g)
                log = log_dir / f"router-lease-{g}.log"
                port, process = _router(log, [
                    "--engine", static, "--config", str(config), "--mesh-bind", f"127.0.0.1:{g}", "--seeds", seeds,
                    "--mesh-secret-file", str(secret)])
                routers.append((f"http://127.0.0.1:{port}", await stack.enter_async_context(process), log))
            for url, proc, log in routers:
                await wait_ready(client, url + "/ready", proc, log, timeout=120)
            outcome = await _kill_holder(client, [(u, p) for u, p, _ in routers], state)
        engines_nursery.cancel_scope.cancel()
    return outcome


async def _kill_holder(client: HttpClient, routers, state: Path) -> tuple[float | None, int]:
    async def reports(urls: list[str]) -> list[dict]:
        out = []
        for url in urls:
            try:
                out.append(await client.get_json(url + "/admin/autoscaler", timeout=2.0))
            except (*TRANSPORT_ERRORS, trio.TooSlowError, ValueError):
                pass
        return out  # type: ignore[return-value]

    urls = [u for u, _ in routers]
    with trio.move_on_after(60):
        while True:
            seen = await reports(urls)
            acting = [i for i, r in enumerate(seen) if r["acting"]]
            if len(seen) == 3 and len(acting) == 1 and seen[acting[0]]["managed"]:
                break
            await trio.sleep(0.2)
    holder = acting[0] if len(seen) == 3 and len(acting) == 1 else None
    if holder is None:
        return None, 0
    term = seen[holder]["lease"]["term"]
    routers[holder][1].send_signal(signal.SIGKILL)
    killed = trio.current_time()
    survivors = [u for i, u in enumerate(urls) if i != holder]
    took = None
    with trio.move_on_after(15):
        while True:
            acting_now = [r for r in await reports(survivors) if r["acting"] and r["lease"]["term"] > term]
            if acting_now:
                took = trio.current_time() - killed
                break
            await trio.sleep(0.05)
    await trio.sleep(3.0)
    provisions = int(json.loads(state.read_text()).get("provisions", 0)) if state.exists() else 0
    return took, provisions


def _row(record: RunRecord, setup: Setup) -> str:
    ttfts = record.ttfts()
    bad, windows = record.slo_windows(setup.window_s, setup.ceiling_s)
    ups = sum(d["count"] for d in record.scale_events() if d["action"] == "up")
    downs = sum(d["count"] for d in record.scale_events() if d["action"] == "down")
    return (f"{record.label:14} {len(record.results):8d} {record.engine_seconds():10.0f} {record.cost():8.3f} "
            f"{percentile(ttfts, 50) * 1000:9.0f} {percentile(ttfts, 99) * 1000:9.0f} {record.failed:6d} "
            f"{bad:4d}/{windows:<4d} {ups:4d}/{downs:<4d}")


def report(records: list[RunRecord], setup: Setup) -> str:
    head = (f"{'run':14} {'requests':>8} {'engine-s':>10} {'cost $':>8} {'ttft p50':>9} {'ttft p99':>9} "
            f"{'failed':>6} {'SLO miss':>9} {'up/down':>9}")
    note = (f"(TTFT in ms; SLO miss: windows of {setup.window_s:.0f} s, the trace's minutes, whose TTFT p99 "
            f"exceeded {setup.ceiling_s:.2f} s; cost at ${setup.price_per_hour}/engine-hour)")
    return "\n".join([head, *(_row(r, setup) for r in records), note])


def plot(records: list[RunRecord], setup: Setup, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = Trace(setup.duration_s, setup.peak_rps)
    fig, (load, count, ttft) = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    ts = [i * 0.5 for i in range(int(setup.duration_s * 2))]
    load.plot(ts, [trace.rate(t) for t in ts], color="black")
    load.set_ylabel("offered load (req/s)")
    for record in records:
        points = sorted(record.samples) + [(setup.duration_s, sorted(record.samples)[-1][1])]
        count.step([p[0] for p in points], [p[1] for p in points], where="post", label=record.label)
        p99s = record.window_p99(setup.window_s)
        ttft.plot([(i + 0.5) * setup.window_s for i in range(len(p99s))],
                  [min(p, 30.0) for p in p99s], marker=".", label=record.label)
    count.set_ylabel("engines")
    count.legend()
    ttft.axhline(setup.ceiling_s, color="red", linestyle="--", label="ceiling")
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT p99 per window (s)")
    ttft.set_xlabel("seconds into the trace")
    ttft.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run_all(setup: Setup, log_dir: Path, lease: bool
                  ) -> tuple[list[RunRecord], float, tuple[float | None, int] | None]:
    client = HttpClient()
    try:
        records, pressure = await run_fleets(client, setup, log_dir)
        handover = await lease_handover(client, log_dir) if lease else None
    finally:
        await client.aclose()
    return records, pressure, handover


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench autoscale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a 90 s trace (3 s windows) instead of 600 s")
    p.add_argument("--plot", type=Path, help="PNG path (default: autoscale.png in the log folder)")
    p.add_argument("--no-lease", action="store_true", help="skip the lease handover check")
    p.add_argument("--log-dir", type=Path)
    args = p.parse_args(argv)
    setup = QUICK if args.quick else FULL
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvmesh-autoscale-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"process logs: {log_dir}", file=sys.stderr)
    trace = Trace(setup.duration_s, setup.peak_rps)
    print(f"trace: {setup.duration_s:.0f} s, peak {setup.peak_rps} req/s, mean {trace.mean_rps():.1f} req/s; "
          f"fixed fleets of {setup.peak_engines} (peak) and {setup.average_engines} (average) engines")
    try:
        records, pressure, handover = trio.run(run_all, setup, log_dir, not args.no_lease)
    except StartFailed as exc:
        print(f"kvmesh bench autoscale: {exc}", file=sys.stderr)
        return 2
    print(report(records, setup))
    print(f"machine: {os.cpu_count()} cores; some task waited for a core during {pressure:.0%} of the trace "
          f"(CPU pressure); the peak-sized fleet's SLO misses show what the machine alone costs")
    auto = records[0]
    for d in auto.scale_events():
        target = f"offer {d['offer']}" if d["offer"] else f"release {','.join(d['release'])}"
        at = d["at"] - auto.started_unix
        print(f"  scale {d['action']:4} x{d['count']} at {at:+6.1f} s: {d['reason']}; {target}")
    path = args.plot or log_dir / "autoscale.png"
    plot(records, setup, path)
    print(f"plot: {path}")
    verdicts = judge(auto, records[1], records[2], setup.window_s, setup.ceiling_s, setup.cooldown_s, handover)
    for verdict in verdicts:
        print(verdict.line())
    return 1 if any(not v.passed for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
