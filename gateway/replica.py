"""One router replica, built in one place and run in one nursery: the process's composition root.

run_replica
 +- loop-lag watch        (how late the loop wakes tasks: a metric, and ingest's headroom; gateway/loop_lag.py)
 +- collector pauses      (each garbage collection's hold on the process: a metric; gateway/gc_pauses.py)
 +- event ingest          (one subscriber scope per engine; gateway/event_ingest.py)
 +- mesh                  (gossip, replication; with a mesh only)
 |   +- dispatch sweep    (the leader drops expired dispatch entries)
 |   +- tombstone sweep   (the leader drops removed engines' entries after an hour)
 |   +- limit sharing     (tenants' rate-limit counts; with limits only)
 +- planner               (tokenizer workers, deferred encodes; gateway/route_planner.py)
 +- fleet                 (one watcher per engine: health, discovery, metrics; gateway/fleet.py)
 +- autoscaler            (lease, decisions, provisions, drains; when enabled)

``gateway/server.py`` runs this beside the HTTP server (``gateway/asgi_server.py``) serving
``Replica.router`` and handles signals and the drain. Seams for in-process tests: ``forward`` (the
proxy), ``watch`` (an engine's watcher), ``provider`` (the autoscaler's provider) and ``connect`` (how
engine pools open connections).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

from autoscale.loop import AutoscaleLoop
from autoscale.providers.base import Provider
from events.curve import CurveClient
from events.ingest_budget import IngestBudget
from events.subscriber import SubscriberConfig
from gateway.admin import AdminApi
from gateway.autoscale_link import build_autoscaler
from gateway.config import RouterConfig
from gateway.engine_watch import watch_engine
from gateway.engines import EngineRegistry
from gateway.event_ingest import EventIngest
from gateway.fleet import Fleet, Watch
from gateway.gatekeeper import Gatekeeper
from gateway.gc_pauses import timing_gc
from gateway.loop_lag import watch_loop_lag
from gateway.mesh_link import (
    build_mesh_node,
    follow_mesh,
    isolate,
    leave_mesh,
    mesh_report,
    run_mesh_tasks,
)
from gateway.mesh_metrics import MeshCollector
from gateway.mesh_state import MeshState
from gateway.metrics import RouterMetrics
from gateway.process_ingest import ProcessIngest
from gateway.proxy import Forward, forward
from gateway.route_planner import RoutePlanner
from gateway.router import Router
from gateway.upstream import Connect
from mesh.node import MeshNode


@dataclass
class Replica:
    """Every long-lived part of one router process."""

    config: RouterConfig
    metrics: RouterMetrics
    engines: EngineRegistry
    mesh: MeshNode | None
    mesh_state: MeshState | None
    planner: RoutePlanner
    ingest: EventIngest
    fleet: Fleet
    gate: Gatekeeper
    router: Router
    autoscaler: AutoscaleLoop | None

    def observe_gc_pause(self, generation: int, pause_s: float) -> None:
        self.metrics.gc_pause.labels(generation=str(generation)).observe(pause_s)

    def observe_loop_lag(self, lag_s: float) -> None:
        """The loop's lag is both a metric and ingest's headroom signal (events/ingest_budget.py)."""
        self.metrics.loop_lag.observe(lag_s)
        now = trio.current_time()
        self.ingest.budget.observe_lag(now, lag_s)
        self.metrics.ingest_share.set(self.ingest.budget.share_now(now))

    async def leave(self) -> None:
        await leave_mesh(self.mesh)


def build_replica(config: RouterConfig, *, forward: Forward = forward, watch: Watch = watch_engine,
                  provider: Provider | None = None, connect: Connect | None = None) -> Replica:
    """Build every part of a replica from its config; nothing runs until ``run_replica``."""
    engines = EngineRegistry(connect)
    for engine in config.engines:
        engines.add(engine)
    metrics = RouterMetrics()
    mesh = build_mesh_node(config)
    mesh_state = MeshState(mesh) if mesh is not None else None
    if mesh is not None and mesh_state is not None:
        metrics.registry.register(MeshCollector(mesh, mesh_state))
    member_id = mesh.member_id if mesh is not None else "local"
    planner = RoutePlanner(config, engines, metrics)
    budget = IngestBudget(serving=lambda: router.active_requests > 0)
    if config.ingest_process:
        ingest: EventIngest = ProcessIngest(planner.cache, mesh, budget=budget,
                                            curve_secret_file=config.events_curve_secret_file,
                                            log_level=config.log_level)
    else:
        curve = CurveClient.load(config.events_curve_secret_file) if config.events_curve_secret_file else None
        ingest = EventIngest(planner.cache, mesh, budget=budget, subscriber=SubscriberConfig(curve_client=curve))
    fleet = Fleet(engines, planner, ingest, metrics, config.metrics_interval_s, watch)
    autoscaler = None
    if config.autoscaler.enabled:
        autoscaler = build_autoscaler(config.autoscaler, fleet, metrics.ttft, config.island, mesh_state, member_id,
                                      metrics.registry, provider)

    def autoscaler_report() -> dict[str, Any]:
        return autoscaler.report() if autoscaler is not None else {"enabled": False}

    admin = AdminApi(fleet, config.limits, lambda: mesh_report(mesh, ingest.ingesting(), dict(ingest.stats)),
                     lambda isolated: isolate(mesh, isolated), autoscaler_report)
    gate = Gatekeeper(config, metrics, member_id)
    router = Router(config, engines=engines, metrics=metrics, planner=planner, fleet=fleet, gate=gate, mesh=mesh,
                    admin=admin, forward=forward)
    return Replica(config, metrics, engines, mesh, mesh_state, planner, ingest, fleet, gate, router, autoscaler)


async def run_replica(replica: Replica, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
    """Start every long-lived task of the replica, in order, in one nursery; cancelling it stops them all."""
    with timing_gc(replica.observe_gc_pause):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_loop_lag, replica.observe_loop_lag)
            await nursery.start(replica.ingest.run)
            if replica.mesh is not None and replica.mesh_state is not None:
                await nursery.start(replica.mesh.run)
                follow_mesh(replica.fleet, replica.mesh_state)
                nursery.start_soon(run_mesh_tasks, replica.mesh_state)
                if replica.gate.has_limits:
                    nursery.start_soon(replica.gate.share_limits, replica.mesh_state)
            await nursery.start(replica.planner.run)
            await nursery.start(replica.fleet.run)
            if replica.autoscaler is not None:
                await nursery.start(replica.autoscaler.run)
            task_status.started()
