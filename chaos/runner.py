"""One chaos run: load, monitor and fault schedule in one nursery, then the invariant check.

run_chaos
 +- Monitor.run          (samples until the run ends)
 +- LoadGenerator.run    (open-loop load through HAProxy until the run ends)
 +- flood                (holder faults: one tenant's long prompts from the inject to the heal)
 +- apply_schedule       (the nursery's body: inject/heal on time, then the tail; heals leftovers)
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from bench.client import HttpClient, model_name
from chaos.faults import FaultInjector, engine_id
from chaos.invariants import Evaluation, Limits, actors, evaluate, killed_for_good
from chaos.load import ChaosWorkload, FloodWorkload, LoadGenerator
from chaos.monitor import Monitor
from chaos.records import FaultAction, RequestRecord, Sample
from chaos.scenarios import HOLDER_FAULTS, STREAMING, FaultEvent, Topology, schedule, warmup_for
from cluster.router_config import FLOOD_TENANT, STEADY_TENANT
from cluster.state import ClusterState

HEAL_TIMEOUT_S = 90.0
STREAM_TOKENS = 200
"""Answer length in the streaming scenarios: long enough that kills land mid-stream."""
TAIL_S = 5.0
STREAM_TAIL_S = 15.0
"""More tail for long streams: a request is recorded when it ends, and the last fault's watch (a restarted
engine's first request) needs the streams started after its heal to have ended."""
# The load may outlast the requested duration this much while slow restarts push the schedule back.
MAX_STRETCH_S = 180.0
HOLDER_TAIL_S = 12.0
"""After a holder fault: watch this long (or as long as the partition lasted, if shorter, but at least
``TAIL_S``) once the flood has been answered and another router acts, so the hit rate has its recovery
window (10 s) to be judged in; a shorter watch leaves that verdict undetermined, not failed."""
HANDOVER_TIMEOUT_S = 30.0
"""How long the run waits for another router to act after the holder died (the lease TTL is 3 s)."""
FLOOD_TIMEOUT_S = 120.0
"""A flood prompt queues behind the others: a slow answer is the flooding tenant's own doing, not a failure."""


@dataclass(frozen=True)
class ChaosOptions:
    scenario: str
    duration: float = 60.0
    rate: float = 20.0
    seed: int = 0
    fault_s: float = 2.0
    interval: float = 0.5
    request_timeout: float = 30.0
    limits: Limits = Limits()
    flood_rate: float = 1.0
    """Holder faults: long prompts per second from the flooding tenant while the partition lasts."""


@dataclass
class ChaosRun:
    options: ChaosOptions
    events: list[FaultEvent]
    records: list[RequestRecord]
    skipped: int
    actions: list[FaultAction]
    samples: list[Sample]
    wall: float
    evaluation: Evaluation


def topology_of(state: ClusterState) -> Topology:
    return Topology(len(state.by_role("router")), len(state.by_role("engine")), bool(state.by_role("redis")),
                    bool(state.pool_file and state.keys_file))


def one_survivor_acts(samples: list[Sample], killed: set[str]) -> bool:
    """The last round shows exactly one router acting as the autoscaler, and not one a fault ended."""
    return bool(samples) and len(actors(samples[-1])) == 1 and not set(actors(samples[-1])) & killed


async def flood(load: LoadGenerator, rate: float, at: float, seconds: float, t0: float, done: trio.Event) -> None:
    """The flooding tenant's load from ``at`` (run seconds) for ``seconds``; ``done`` once all was answered."""
    await trio.sleep_until(t0 + at)
    await load.run(rate, seconds)
    done.set()


async def apply_schedule(injector: FaultInjector, events: list[FaultEvent], t0: float) -> float:
    """Inject and heal each event; returns when the last heal was done (run seconds).

    A heal that finishes late (a slow restart) pushes the later events back by as much, so each fault
    keeps its planned duration and every healed fault keeps its planned quiet time after it. Whatever is
    still broken when this ends, also on cancellation, is healed (shielded, bounded).
    """
    broken: dict[int, FaultEvent] = {}
    shift = 0.0
    try:
        for n, event in enumerate(events):
            await trio.sleep_until(t0 + event.inject_at + shift)
            injected = trio.current_time()
            broken[n] = event
            await injector.inject(n, event)
            await trio.sleep_until(injected + event.heal_at - event.inject_at)
            await injector.heal(n, event)
            del broken[n]
            shift = max(shift, trio.current_time() - t0 - event.heal_at)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(HEAL_TIMEOUT_S):
            injector.resume_paused()
            for n, event in broken.items():
                await injector.heal(n, event)
    return trio.current_time() - t0


async def run_chaos(state: ClusterState, options: ChaosOptions) -> ChaosRun:
    """Run ``options.scenario`` against the cluster ``state`` describes, then check every invariant."""
    events = schedule(options.scenario, options.duration, topology_of(state), options.fault_s)
    holder = any(e.kind in HOLDER_FAULTS for e in events)
    keys = state.keys()
    admin = [("authorization", f"Bearer {keys.admin}")] if keys else []
    client = HttpClient()
    t0 = trio.current_time()

    def clock() -> float:
        return trio.current_time() - t0

    def tenant_load(workload: ChaosWorkload | FloodWorkload, tenant: str, timeout: float) -> LoadGenerator:
        return LoadGenerator(client, state.haproxy_url, workload, clock, timeout, tenant if keys else "",
                             keys.tenants[tenant] if keys else "")

    try:
        streaming = options.scenario in STREAMING
        model = await model_name(client, state.haproxy_url)
        workload = ChaosWorkload(model, options.seed, max_tokens=STREAM_TOKENS if streaming else 8,
                                 streamed_only=streaming)
        t0 = trio.current_time()
        injector = FaultInjector(state, client, clock, headers=admin)
        monitor = Monitor(state, client, clock, options.interval, headers=admin)
        load = tenant_load(workload, STEADY_TENANT, options.request_timeout)
        flooding = tenant_load(FloodWorkload(model, options.seed), FLOOD_TENANT, FLOOD_TIMEOUT_S)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(monitor.run)
            nursery.start_soon(load.run, options.rate, options.duration + MAX_STRETCH_S)
            flood_done = trio.Event()
            if holder:
                nursery.start_soon(flood, flooding, options.flood_rate, events[0].inject_at, options.fault_s, t0,
                                   flood_done)
            last_heal = await apply_schedule(injector, events, t0)
            tail = TAIL_S + (STREAM_TAIL_S if streaming else 0.0)
            if holder:
                with trio.move_on_after(HANDOVER_TIMEOUT_S):
                    await flood_done.wait()
                    while not one_survivor_acts(monitor.samples, killed_for_good(injector.actions)):
                        await trio.sleep(options.interval)
                last_heal, tail = clock(), max(TAIL_S, min(HOLDER_TAIL_S, options.fault_s))
            await trio.sleep_until(t0 + max(options.duration, last_heal + tail))
            run_end = clock()
            nursery.cancel_scope.cancel()
    finally:
        await client.aclose()
    records = load.records + flooding.records
    flood_end = max((r.end for r in flooding.records), default=0.0)
    evaluation = evaluate(records, injector.actions, monitor.samples, [r.name for r in state.by_role("router")],
                          [engine_id(r) for r in state.by_role("engine")], run_end, warmup_for(options.duration),
                          options.limits, streams_continue=options.scenario in STREAMING, load_until=flood_end)
    return ChaosRun(options, events, records, load.skipped(run_end) + flooding.skipped(run_end), injector.actions,
                    monitor.samples, run_end, evaluation)
