"""Chaos scenarios as schedules: which fault hits which process, when it is injected and when healed.

Pure data, so a schedule can be checked (no two faults overlap, every fault heals inside the run)
before anything is killed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FAULT_ROLES = {
    "kill-router": "router",
    "kill-engine": "engine",
    "pause-engine": "engine",
    "pause-router": "router",
    "restart-engine": "engine",
    "partition-router": "router",
    "kill-redis": "redis",
    "drop-events": "engine",
    "partition-kill-holder": "router",
}
HOLDER_FAULTS = frozenset({"partition-kill-holder"})
"""Faults whose target is the router acting as the autoscaler, found when the fault is injected: it is cut
off from the mesh (it keeps serving HTTP) and, at the heal, killed for good. They run once per scenario
(a second one would leave one of three replicas, no quorum), need three routers (a majority keeps an
actor) and an autoscaler, and one tenant floods the cluster with long prompts while the partition lasts."""
HOLDER_FAULT_S = 90.0
"""The partition's default length: longer than the minute after which a sliding window of replicas "seen
lately" would let the cut-off holder count itself a majority again."""
# The mixed order alternates roles so consecutive faults do not pile onto the same kind of process.
MIXED_ORDER = ("kill-engine", "pause-router", "drop-events", "kill-router", "pause-engine", "kill-redis",
               "restart-engine", "partition-router")
STREAMING = {"kill-engine-streaming": "kill-engine"}
"""Scenarios under long streamed answers, by the fault they repeat: a stream whose engine dies must be
continued elsewhere, so no client sees a failure while an engine is alive."""
SCENARIOS = (*FAULT_ROLES, "mixed", *STREAMING)
# A restart is its own heal: the engine comes back cold as soon as it can.
INSTANT_HEAL = frozenset({"restart-engine"})
RECOVERY_S = 10.0


@dataclass(frozen=True)
class FaultEvent:
    kind: str
    role: str
    target: int
    inject_at: float
    heal_at: float


@dataclass(frozen=True)
class Topology:
    routers: int
    engines: int
    redis: bool
    autoscaler: bool = False
    """The routers run an autoscaler with a standby pool, and tenants (``kvmesh up --standby N --auth``)."""


def feasible(kind: str, topology: Topology) -> str:
    """Why ``kind`` cannot run on this cluster ("" when it can): faults need a survivor to fail over to."""
    role = FAULT_ROLES[kind]
    if kind in HOLDER_FAULTS and (topology.routers < 3 or not topology.autoscaler):
        return "needs 3 routers with an autoscaler and tenants ('kvmesh up --routers 3 --standby 2 --auth')"
    if role == "router" and topology.routers < 2:
        return "router faults need at least 2 routers"
    if role == "engine" and topology.engines < 2:
        return "engine faults need at least 2 engines"
    if role == "redis" and not topology.redis:
        return "the cluster runs without Redis"
    return ""


def warmup_for(duration: float) -> float:
    """Load runs this long before the first fault, so the pre-fault hit rate has a window to measure."""
    return max(3.0, min(10.0, 0.1 * duration))


def schedule(name: str, duration: float, topology: Topology, fault_s: float = 2.0) -> list[FaultEvent]:
    """The fault events of scenario ``name`` for a run of ``duration`` seconds.

    A single-fault scenario repeats its fault every ``fault_s + RECOVERY_S`` seconds (at least once),
    rotating over targets. ``mixed`` runs each feasible kind once, evenly spaced, so it needs at least
    ``fault_s + 3`` seconds per kind. Raises ValueError when the scenario cannot run on this cluster.
    """
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; expected one of {', '.join(SCENARIOS)}")
    if duration <= 0 or fault_s <= 0:
        raise ValueError("duration and fault duration must be positive")
    warmup = warmup_for(duration)
    if name == "mixed":
        kinds = [k for k in MIXED_ORDER if not feasible(k, topology)]
        if not kinds:
            raise ValueError("no fault kind is feasible on this cluster")
        slot = (duration - warmup) / len(kinds)
        if slot < fault_s + 3.0:
            raise ValueError(f"mixed needs at least {warmup + len(kinds) * (fault_s + 3.0):.0f} s on this cluster")
    else:
        kind = STREAMING.get(name, name)
        reason = feasible(kind, topology)
        if reason:
            raise ValueError(f"{name}: {reason}")
        slot = fault_s + RECOVERY_S
        kinds = [kind] * (1 if kind in HOLDER_FAULTS else max(1, math.floor((duration - warmup) / slot)))
        if kind in HOLDER_FAULTS and warmup + fault_s > duration:
            raise ValueError(f"{name} needs --duration of at least {warmup + fault_s:.0f} s for a {fault_s:g} s fault")
    counts = {"router": topology.routers, "engine": topology.engines, "redis": 1}
    used = dict.fromkeys(counts, 0)
    events = []
    for k, kind in enumerate(kinds):
        role = FAULT_ROLES[kind]
        target = used[role] % counts[role]
        used[role] += 1
        inject = warmup + k * slot
        events.append(FaultEvent(kind, role, target, inject, inject if kind in INSTANT_HEAL else inject + fault_s))
    return events
