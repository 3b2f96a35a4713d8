"""The autoscaler at the edge: one trio task per router replica, acting only while it holds the lease.

AutoscaleLoop.run
 +- lease loop      (renew or claim the lease, keep the member list; autoscale/lease.py)
 +- decision loop   (every interval: signals -> Autoscaler.decide -> log, gauges, shared state, act)
 +- provider tasks  (provisioning; a ready engine is registered with every router through FleetControl)
 +- adoption, drains (no new requests; wait until idle or the deadline; terminate; remove)

Every one of them runs under autoscale/supervise.py: whatever a provider or a peer's value raises is
logged once, counted (``kvmesh_autoscaler_task_failures``) and the task goes on or ends alone. Whether
this replica may act is checked again (on the wall clock) right before each decision and each release,
and every provider call carries the lease term as a fencing token.

Provisions in flight (``pending:``) and the engines the autoscaler started (``engine:``) live in the
document, so a replica that takes the lease over counts them and never provisions twice; without a mesh
they live in this process.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from typing import Any

import trio
from prometheus_client import Counter, Gauge

from autoscale.config import AutoscaleConfig
from autoscale.decision import Autoscaler, Decision
from autoscale.lease import ACT_MARGIN, Lease, LeaseKeeper, parse_members
from autoscale.ports import FleetControl, SignalSource
from autoscale.providers.base import Provider, ProviderError, ProvisionResult
from autoscale.providers.command import CommandProvider
from autoscale.providers.local import LocalProvider
from autoscale.supervise import TaskFaults, guarded, supervise

log = logging.getLogger("kvmesh.autoscaler")
KEPT_DECISIONS = 20
IDLE_CHECKS = 2
"""Consecutive idle looks (half a second apart) before a drained engine is released."""
STREAM_HANDOVER_S = 2.0
"""Before the drain deadline, streams still on the engine are handed to others this long ahead."""


def make_provider(config: AutoscaleConfig) -> Provider:
    if config.provider == "command":
        return CommandProvider(config.command, config.command_timeout_s, config.command_env)
    return LocalProvider(config.sim_args, provisioning_scale=config.provisioning_scale)


def number(value: Any) -> float:
    """A number from a document value a peer wrote: 0.0 unless it is a finite int or float."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0


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
        self.task_failures = Counter("kvmesh_autoscaler_task_failures", "Autoscaler task failures caught and "
                                     "survived", ["task", "reason"], registry=registry)


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
        started = time.time()
        self.keeper = LeaseKeeper(self.me, self.config.lease_ttl_s, replicas=self.config.replicas,
                                  join_s=self.config.join_s, forget_s=self.config.member_forget_s,
                                  started_at=started)
        self.metrics = AutoscalerMetrics(registry)
        self.faults = TaskFaults(lambda task, reason: self.metrics.task_failures.labels(task, reason).inc(), log,
                                 "autoscaler")
        self.acting = self.state is None
        self.term = int(started * 1000) if self.state is None else 0
        """The fencing token of this replica's calls: the lease term (without a mesh, the start time in ms,
        so a restarted router's requests still outrank its predecessor's)."""
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
                nursery.start_soon(supervise, self.faults, "lease", self._lease_loop)
            task_status.started()
            await supervise(self.faults, "decide", self._decision_loop)

    async def _decision_loop(self) -> None:
        while True:
            await trio.sleep(self.config.interval_s)
            self.tick(time.time())
            self.faults.succeeded("decide")

    async def _lease_loop(self) -> None:
        while True:
            self.lease_step(time.time())
            self.faults.succeeded("lease")
            await trio.sleep(self.config.lease_ttl_s / 6)

    def lease_step(self, now: float) -> None:
        """Renew or claim the lease, keep the member list while acting, take over when just acquired."""
        assert self.state is not None
        node = self.state.node
        current = self.lease()
        members = parse_members(self.state.members())
        alive = node.alive_members()
        claim = self.keeper.claim(current, now, alive, members)
        if claim is not None and not node.isolated:
            self.state.write_lease(claim.to_json())
            current = claim
        acting = self.keeper.acting(current, now, alive, members, node.isolated)
        if acting and current is not None:
            update = self.keeper.members_update(now, alive, members, node.departed_members())
            if update is not None:
                self.state.write_members(update)
            if current.term != self.term:
                self.term = current.term
                self._took_over(current)
        self.acting = acting
        self.metrics.holder.set(1 if acting else 0)

    def may_act(self, now: float) -> bool:
        """Checked right before acting: the lease this replica acts under is still in the document with more
        than ACT_MARGIN of its TTL left (a loop that stalled past that must not act on the old verdict)."""
        if not self.acting:
            return False
        if self.state is None:
            return True
        lease = self.lease()
        return (lease is not None and lease.holder == self.me and lease.term == self.term
                and lease.expires_at - now > self.config.lease_ttl_s * ACT_MARGIN)

    def _took_over(self, lease: Lease) -> None:
        """Continue from the shared state: the last change (for cooldowns) and engines nobody registered."""
        shared = self._entries("state").get("state", {})
        last = shared.get("last_change")
        if isinstance(last, list) and len(last) == 2 and last[1] in ("up", "down"):
            self.core.last_change = (number(last[0]), last[1])
        log.info("autoscaler lease taken", extra={"holder": self.me, "term": lease.term})
        assert self._nursery is not None
        self._nursery.start_soon(guarded, self.faults, "adopt", self._adopt)

    async def _adopt(self) -> None:
        """Register engines the provider lists but no router knows (a holder died before registering)."""
        try:
            listed = await self.provider.list(self.term)
        except ProviderError as exc:
            self.metrics.errors.labels("list").inc()
            log.warning("autoscaler provider list failed", extra={"error": str(exc)})
            return
        for engine in listed:
            if not self.fleet.known(engine.id):
                self._register(engine.id, engine.url, engine.island, engine.offer)

    # ----- one decision -----------------------------------------------------------------------------

    def tick(self, now: float) -> Decision | None:
        if not self.may_act(now):
            self._export_shared()
            return None
        started = time.perf_counter()
        pending = self._live_pending(now)
        managed = {key.removeprefix("engine:"): number(v.get("price_per_hour"))
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
            if number(value.get("deadline")) < now:
                self._set(key, None)
                del pending[key]
        return pending

    def _act(self, decision: Decision, now: float) -> None:
        if decision.action == "up" and decision.offer is not None:
            offer = decision.offer
            deadline = now + 2 * offer.provisioning_s * self.config.provisioning_scale + 60
            for _ in range(decision.count):
                request_id = self.provider.provision(offer, self._on_ready, self.term)
                self._set(f"pending:{self.me}:{request_id}", {"offer": offer.name, "holder": self.me,
                                                              "deadline": deadline})
        elif decision.action == "down":
            assert self._nursery is not None
            for engine_id in decision.release:
                self.draining.add(engine_id)
                self.fleet.drain(engine_id, self.config.drain_deadline_s - STREAM_HANDOVER_S)
                self._nursery.start_soon(self._guarded_drain, engine_id)

    def _on_ready(self, result: ProvisionResult) -> None:
        """The provider's callback: whatever goes wrong here is counted, never raised into its task."""
        try:
            self._ready(result)
        except Exception as exc:  # an engine the provider returned must not end the router
            self.faults.failed("ready", exc)

    def _ready(self, result: ProvisionResult) -> None:
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

    async def _guarded_drain(self, engine_id: str) -> None:
        """A drain that failed leaves the engine drained and forgotten here; the router goes on."""
        if not await guarded(self.faults, "drain", lambda: self._drain(engine_id)):
            self.draining.discard(engine_id)

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
        if not self.may_act(time.time()):
            log.warning("autoscaler lease lost during a drain; the engine is left to the next holder",
                        extra={"engine": engine_id})
            self.fleet.undrain(engine_id)
            self.draining.discard(engine_id)
            return
        try:
            await self.provider.terminate(engine_id, self.term)
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
            self._export(decisions[-1], int(number(shared.get("pending"))), int(number(shared.get("fleet"))))

    def report(self) -> dict[str, Any]:
        """``GET /admin/autoscaler``: the same on every replica (the holder's shared state)."""
        shared = self._entries("state").get("state", {})
        lease = self.lease()
        acting = self.may_act(time.time())
        decisions = list(self.decisions) if acting else shared.get("decisions", [])
        return {
            "enabled": True, "me": self.me, "acting": acting, "dry_run": self.config.dry_run,
            "term": self.term,
            "provider": self.config.provider,
            "lease": dataclasses.asdict(lease) if lease else None,
            "holder": lease.holder if lease else (self.me if acting else None),
            "pending": sorted(self._entries("pending:")),
            "managed": sorted(k.removeprefix("engine:") for k in self._entries("engine:")),
            "draining": sorted(self.draining) if acting else shared.get("draining", []),
            "last_change": shared.get("last_change"),
            "triggers": decisions[-1]["triggers"] if decisions else {},
            "decisions": decisions,
            "offers": [dataclasses.asdict(o) for o in self.core.offers],
        }
