"""One chaos run: load, monitor and fault schedule in one nursery, then the invariant check.

run_chaos
 +- Monitor.run          (samples until the load is done)
 +- _apply_schedule      (inject/heal at the scheduled times; heals anything left on the way out)
 +- run_load             (the body of the nursery: open-loop load through HAProxy)
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from bench.client import HttpClient, model_name
from chaos.faults import FaultInjector, engine_id
from chaos.invariants import Evaluation, Limits, evaluate
from chaos.load import ChaosWorkload, run_load
from chaos.monitor import Monitor
from chaos.records import FaultAction, RequestRecord, Sample
from chaos.scenarios import FaultEvent, Topology, run_length, schedule, warmup_for
from cluster.state import ClusterState

HEAL_TIMEOUT_S = 90.0


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


async def _apply_schedule(injector: FaultInjector, events: list[FaultEvent], t0: float) -> None:
    """Inject and heal each event on time; whatever is still broken when this ends (also on
    cancellation) is healed, shielded and bounded, so the cluster is whole after every run."""
    broken: dict[int, FaultEvent] = {}
    try:
        for n, event in enumerate(events):
            await trio.sleep_until(t0 + event.inject_at)
            broken[n] = event
            await injector.inject(n, event)
            await trio.sleep_until(t0 + event.heal_at)
            await injector.heal(n, event)
            del broken[n]
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(HEAL_TIMEOUT_S):
            injector.resume_paused()
            for n, event in broken.items():
                await injector.heal(n, event)


async def run_chaos(state: ClusterState, options: ChaosOptions) -> ChaosRun:
    """Run ``options.scenario`` against the cluster ``state`` describes and check every invariant."""
    events = schedule(options.scenario, options.duration, topology_of(state), options.fault_s)
    length = run_length(events, options.duration)
    client = HttpClient()
    t0 = trio.current_time()

    def clock() -> float:
        return trio.current_time() - t0

    try:
        workload = ChaosWorkload(await model_name(client, state.haproxy_url), options.seed)
        t0 = trio.current_time()
        injector = FaultInjector(state, client, clock)
        monitor = Monitor(state, client, clock, options.interval)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(monitor.run)
            nursery.start_soon(_apply_schedule, injector, events, t0)
            records, skipped = await run_load(client, state.haproxy_url, workload, options.rate, length, clock,
                                              options.request_timeout)
            run_end = clock()
            nursery.cancel_scope.cancel()
    finally:
        await client.aclose()
    evaluation = evaluate(records, injector.actions, monitor.samples, [r.name for r in state.by_role("router")],
                          [engine_id(r) for r in state.by_role("engine")], run_end, warmup_for(options.duration),
                          options.limits)
    return ChaosRun(options, events, records, skipped, injector.actions, monitor.samples, run_end, evaluation)
