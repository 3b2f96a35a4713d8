"""One chaos run: load, monitor and fault schedule in one nursery, then the invariant check.

run_chaos
 +- Monitor.run          (samples until the run ends)
 +- LoadGenerator.run    (open-loop load through HAProxy until the run ends)
 +- apply_schedule       (the nursery's body: inject/heal on time, then the tail; heals leftovers)
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from bench.client import HttpClient, model_name
from chaos.faults import FaultInjector, engine_id
from chaos.invariants import Evaluation, Limits, evaluate
from chaos.load import ChaosWorkload, LoadGenerator
from chaos.monitor import Monitor
from chaos.records import FaultAction, RequestRecord, Sample
from chaos.scenarios import STREAMING, FaultEvent, Topology, schedule, warmup_for
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
    return Topology(len(state.by_role("router")), len(state.by_role("engine")), bool(state.by_role("redis")))


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
    client = HttpClient()
    t0 = trio.current_time()

    def clock() -> float:
        return trio.current_time() - t0

    try:
        streaming = options.scenario in STREAMING
        workload = ChaosWorkload(await model_name(client, state.haproxy_url), options.seed,
                                 max_tokens=STREAM_TOKENS if streaming else 8, streamed_only=streaming)
        t0 = trio.current_time()
        injector = FaultInjector(state, client, clock)
        monitor = Monitor(state, client, clock, options.interval)
        load = LoadGenerator(client, state.haproxy_url, workload, clock, options.request_timeout)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(monitor.run)
            nursery.start_soon(load.run, options.rate, options.duration + MAX_STRETCH_S)
            last_heal = await apply_schedule(injector, events, t0)
            tail = TAIL_S + (STREAM_TAIL_S if streaming else 0.0)
            await trio.sleep_until(t0 + max(options.duration, last_heal + tail))
            run_end = clock()
            nursery.cancel_scope.cancel()
    finally:
        await client.aclose()
    evaluation = evaluate(load.records, injector.actions, monitor.samples, [r.name for r in state.by_role("router")],
                          [engine_id(r) for r in state.by_role("engine")], run_end, warmup_for(options.duration),
                          options.limits, streams_continue=options.scenario in STREAMING)
    return ChaosRun(options, events, load.records, load.skipped(run_end), injector.actions, monitor.samples,
                    run_end, evaluation)
