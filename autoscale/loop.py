"""The autoscaler at the edge: one trio task per router replica, acting only while it holds the lease.

AutoscaleLoop.run
 +- lease loop      (renew or claim the lease in the replicated document; autoscale/lease.py)
 +- decision loop   (every interval: signals -> Autoscaler.decide -> log, gauges, shared state, act)
 +- provider tasks  (provisioning; a ready engine is registered with every router through FleetControl)
 +- drains          (no new requests; wait until idle or the deadline; terminate; remove)

Provisions in flight (``pending:``) and the engines the autoscaler started (``engine:``) live in the
document, so a replica that takes the lease over counts them and never provisions twice; without a mesh
they live in this process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Any

import trio
from prometheus_client import Counter, Gauge

from autoscale.config import AutoscaleConfig
from autoscale.decision import Autoscaler, Decision
from autoscale.lease import Lease, LeaseKeeper
from autoscale.ports import FleetControl, SignalSource
from autoscale.providers.base import Provider, ProviderError, ProvisionResult
from autoscale.providers.command import CommandProvider
from autoscale.providers.local import LocalProvider

log = logging.getLogger("kvmesh.autoscaler")
KEPT_DECISIONS = 20
IDLE_CHECKS = 2
"""Consecutive idle looks (half a second apart) before a drained engine is released."""
STREAM_HANDOVER_S = 2.0
"""Before the drain deadline, streams still on the engine are handed to others this long ahead."""


def make_provider(config: AutoscaleConfig) -> Provider:
    if config.provider == "command":
        return CommandProvider(config.command, config.command_timeout_s)
    return LocalProvider(config.sim_args, provisioning_scale=config.provisioning_scale)


class AutoscalerMetrics:
    def __init__(self, registry: Any) -> None:
        self.holder = Gauge("kvmesh_autoscaler_holder", "1 on the replica that holds the autoscaler lease",
                            registry=registry)
        self.engines = Gauge("kvmesh_autoscaler_engines", "Engines by autoscaler state", ["state"],
                             registry=registry)
        self.trigger = Gauge("kvmesh_autoscaler_trigger", "Last decision's inputs (avg_queue, utilisation, "
                             "hit_ratio, ttft_p99_s, demand, capacity, needed)", ["name"], registry=registry)
        self.decisions = Counter("kvmesh_autoscaler_decisions", "Decisions made while holding the lease",
                                 ["action"], registry=registry)
        self.errors = Counter("kvmesh_autoscaler_provider_errors", "Failed provider calls", ["op"],
                              registry=registry)


class AutoscaleLoop:
    def __init__(self, config: AutoscaleConfig, fleet: FleetControl, signals: SignalSource, state: Any, me: str,
                 registry: Any, provider: Provider | None = None) -> None:
        """``state``: the mesh's shared state (None without a mesh); ``me``: this replica's member id;
        ``provider``: the configured one when None."""
        self.config = config
        self.fleet = fleet
        self.signals = signals
        self.core = Autoscaler(self.config.policy(), self.config.offers)
        self.provider = provider or make_provider(self.config)
        self.state = state
        self.me = me
        self.keeper = LeaseKeeper(self.me, self.config.lease_ttl_s)
        self.metrics = AutoscalerMetrics(registry)
        self.acting = self.state is None
        self.decisions: deque[dict[str, Any]] = deque(maxlen=KEPT_DECISIONS)
        self.draining: set[str] = set()
        self._local: dict[str, dict[str, Any]] = {}
        self._nursery: trio.Nursery | None = None

    # ----- shared entries (the document with a mesh, this process without) --------------------------

    def _entries(self, prefix: str) -> dict[str, dict[str, Any]]:
        if self.state is not None:
            return self.state.autoscaler_entries(prefix)
        return {k: v for k, v in self._local.items() if k.startswith(prefix)}

    def _set(self, key: str, value: dict[str, Any] | None) -> None:
        if self.state is not None:
            self.state.set_autoscaler_entry(key, value)
        elif value is None:
            self._local.pop(key, None)
        else:
            self._local[key] = value

    def lease(self) -> Lease | None:
        return Lease.from_json(self.state.lease()) if self.state is not None else None

    # ----- tasks ------------------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.provider.attach(nursery)
            if self.state is not None:
                nursery.start_soon(self._lease_loop)
            task_status.started()
            while True:
                await trio.sleep(self.config.interval_s)
                try:
                    self.tick(time.time())
                except Exception:  # a bug or a surprise from a provider must not take the router down
                    self.metrics.errors.labels("tick").inc()
                    log.exception("autoscaler decision failed")

    async def _lease_loop(self) -> None:
        assert self.state is not None
        node = self.state.node
        while True:
            now = time.time()
            current = self.lease()
            claim = self.keeper.claim(current, now, set(node.live_members()), node.alive_members())
            if claim is not None and not node.isolated:
                self.state.write_lease(claim.to_json())
                current = claim
            acting = self.keeper.acting(current, now, node.isolated)
            if acting and not self.acting:
                self._took_over(current)
            self.acting = acting
            self.metrics.holder.set(1 if acting else 0)
            await trio.sleep(self.config.lease_ttl_s / 6)

    def _took_over(self, lease: Lease | None) -> None:
        """Continue from the shared state: the last change (for cooldowns) and engines nobody registered."""
        shared = self._entries("state").get("state", {})
        last = shared.get("last_change")
        if isinstance(last, list) and len(last) == 2 and last[1] in ("up", "down"):
            self.core.last_change = (float(last[0]), last[1])
        log.info("autoscaler lease taken", extra={"holder": self.me, "term": lease.term if lease else None})
        assert self._nursery is not None
        self._nursery.start_soon(self._adopt)

    async def _adopt(self) -> None:
        """Register engines the provider lists but no router knows (a holder died before registering)."""
        try:
            listed = await self.provider.list()
        except ProviderError as exc:
            self.metrics.errors.labels("list").inc()
            log.warning("autoscaler provider list failed", extra={"error": str(exc)})
            return
        for engine in listed:
            if not self.fleet.known(engine.id):
                self._register(engine.id, engine.url, engine.island, engine.offer)

    # ----- one decision -----------------------------------------------------------------------------

    def tick(self, now: float) -> Decision | None:
        if not self.acting:
            self._export_shared()
            return None
        started = time.perf_counter()
        pending = self._live_pending(now)
        managed = {key.removeprefix("engine:"): float(v.get("price_per_hour", 0.0))
                   for key, v in self._entries("engine:").items()}
        signals = self.signals.read(managed, self.draining, len(pending))
        decision = self.core.decide(signals, now)
        record = decision.as_json()
        log.info("autoscaler decision", extra={"autoscaler": record, "holder": self.me,
                                               "took_ms": round((time.perf_counter() - started) * 1000, 2)})
        self.decisions.append(record)
        self.metrics.decisions.labels(decision.action).inc()
        if not decision.dry_run:
            self._act(decision, now)
        self._set("state", {"holder": self.me, "at": now, "decisions": list(self.decisions),
                            "last_change": list(self.core.last_change) if self.core.last_change else None,
                            "pending": len(self._live_pending(now)), "draining": sorted(self.draining),
                            "fleet": len(signals.engines)})
        self._export(record, len(self._live_pending(now)), len(signals.engines))
        return decision

    def _live_pending(self, now: float) -> dict[str, dict[str, Any]]:
        """Provisions in flight; one past its deadline is dropped (its holder died, or the cloud lost it)."""
        pending = self._entries("pending:")
        for key, value in list(pending.items()):
            if float(value.get("deadline", 0)) < now:
                self._set(key, None)
                del pending[key]
        return pending

    def _act(self, decision: Decision, now: float) -> None:
        if decision.action == "up" and decision.offer is not None:
            offer = decision.offer
            deadline = now + 2 * offer.provisioning_s * self.config.provisioning_scale + 60
            for _ in range(decision.count):
                request_id = self.provider.provision(offer, self._on_ready)
                self._set(f"pending:{self.me}:{request_id}", {"offer": offer.name, "holder": self.me,
                                                              "deadline": deadline})
        elif decision.action == "down":
            assert self._nursery is not None
            for engine_id in decision.release:
                self.draining.add(engine_id)
                self.fleet.drain(engine_id, self.config.drain_deadline_s - STREAM_HANDOVER_S)
                self._nursery.start_soon(self._drain, engine_id)

    def _on_ready(self, result: ProvisionResult) -> None:
        self._set(f"pending:{self.me}:{result.request_id}", None)
        if result.engine is None:
            self.metrics.errors.labels("provision").inc()
            log.warning("autoscaler provision failed", extra={"offer": result.offer.name, "error": result.error})
            return
        engine = result.engine
        self._register(engine.id, engine.url, engine.island, result.offer.name)
        log.info("autoscaler engine ready", extra={"engine": engine.id, "url": engine.url,
                                                   "offer": result.offer.name})

    def _register(self, engine_id: str, url: str, island: str | None, offer_name: str) -> None:
        offer = next((o for o in self.core.offers if o.name == offer_name), None)
        try:
            self.fleet.register(engine_id, url, island)
        except ValueError as exc:
            self.metrics.errors.labels("provision").inc()
            log.warning("autoscaler provider returned an unusable engine", extra={"error": str(exc)})
            return
        self._set(f"engine:{engine_id}", {"url": url, "offer": offer_name,
                                          "price_per_hour": offer.price_per_hour if offer else 0.0})

    async def _drain(self, engine_id: str) -> None:
        """No new requests reach it (draining); release it once idle for a while, or at the deadline. Streams
        still running on it shortly before the deadline are continued on other engines (gateway/proxy.py),
        so releasing it fails nobody."""
        started = trio.current_time()
        deadline = started + self.config.drain_deadline_s
        idle_looks = 0
        while trio.current_time() < deadline and idle_looks < IDLE_CHECKS:
            await trio.sleep(0.5)
            idle_looks = idle_looks + 1 if self.fleet.idle(engine_id, started) else 0
        try:
            await self.provider.terminate(engine_id)
        except ProviderError as exc:
            self.metrics.errors.labels("terminate").inc()
            log.warning("autoscaler terminate failed; the engine stays drained", extra={"engine": engine_id,
                                                                                        "error": str(exc)})
            self.draining.discard(engine_id)
            return
        self.fleet.release(engine_id)
        self._set(f"engine:{engine_id}", None)
        self.draining.discard(engine_id)
        log.info("autoscaler engine released", extra={"engine": engine_id, "idle": idle_looks >= IDLE_CHECKS,
                                                      "drain_s": round(trio.current_time() - started, 2)})

    # ----- what every replica shows -----------------------------------------------------------------

    def _export(self, record: dict[str, Any], pending: int, fleet: int) -> None:
        for name, value in record.get("triggers", {}).items():
            if isinstance(value, int | float):
                self.metrics.trigger.labels(name).set(value)
        self.metrics.engines.labels("pending").set(pending)
        self.metrics.engines.labels("draining").set(len(self.draining))
        self.metrics.engines.labels("total").set(fleet)

    def _export_shared(self) -> None:
        shared = self._entries("state").get("state", {})
        decisions = shared.get("decisions") or []
        if decisions and isinstance(decisions[-1], dict):
            self._export(decisions[-1], int(shared.get("pending", 0)), int(shared.get("fleet", 0)))

    def report(self) -> dict[str, Any]:
        """``GET /admin/autoscaler``: the same on every replica (the holder's shared state)."""
        shared = self._entries("state").get("state", {})
        lease = self.lease()
        decisions = list(self.decisions) if self.acting else shared.get("decisions", [])
        return {
            "enabled": True, "me": self.me, "acting": self.acting, "dry_run": self.config.dry_run,
            "provider": self.config.provider,
            "lease": dataclasses.asdict(lease) if lease else None,
            "holder": lease.holder if lease else (self.me if self.acting else None),
            "pending": sorted(self._entries("pending:")),
            "managed": sorted(k.removeprefix("engine:") for k in self._entries("engine:")),
            "draining": sorted(self.draining) if self.acting else shared.get("draining", []),
            "last_change": shared.get("last_change"),
            "triggers": decisions[-1]["triggers"] if decisions else {},
            "decisions": decisions,
            "offers": [dataclasses.asdict(o) for o in self.core.offers],
        }
