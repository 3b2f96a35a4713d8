"""When to grow or shrink the fleet, by how much, and which engines to give back: sans-IO and deterministic.

The loop (autoscale/loop.py) turns what the router sees into ``FleetSignals`` and calls
``Autoscaler.decide(signals, now)``; the answer is a ``Decision`` to carry out (or only log, in dry-run).
Time is passed in, so every rule here is testable without clocks or processes.

Rules, in order:

- never below ``min_engines`` nor above ``max_engines`` (pending provisions count as engines);
- scale up when the average queue depth exceeds ``queue_up``, or the demand needs more engines than the
  fleet has at ``target_utilisation`` of the measured per-engine capacity, or the hit ratio is under
  ``hit_ratio_floor`` while engines are saturated, or TTFT p99 exceeds ``ttft_p99_ceiling_s``; add as many
  engines as the demand needs at ``target_utilisation`` (at least one);
- scale down when the queue has been under ``queue_drain`` and utilisation under ``utilisation_floor`` for
  ``down_stable_s``: release
  the engines whose loss costs least (fewest blocks no other engine holds, least in flight, dearest first);
- hysteresis: after a change, another in the same direction waits ``step_cooldown_s`` and one in the other
  direction waits ``cooldown_s``, so the direction changes at most once per ``cooldown_s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from autoscale.offers import Offer, Placement, choose_offer

Action = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class ScalePolicy:
    min_engines: int = 1
    max_engines: int = 8
    queue_up: float = 4.0
    """Average waiting requests per engine that calls for more engines."""
    queue_drain: float = 0.5
    """Average waiting requests per engine under which an engine may go (below ``queue_up``: hysteresis)."""
    utilisation_floor: float = 0.35
    """Demand over capacity under which an engine may go."""
    target_utilisation: float = 0.7
    """Demand over capacity that a scale-up sizes the fleet for."""
    hit_ratio_floor: float = 0.2
    saturation: float = 0.9
    """Utilisation from which the engines count as saturated (for the hit-ratio trigger)."""
    ttft_p99_ceiling_s: float = 2.0
    cooldown_s: float = 60.0
    step_cooldown_s: float = 10.0
    down_stable_s: float = 30.0
    """How long the fleet must have been idle before an engine goes (scale up fast, down slowly)."""
    max_step_up: int = 4
    max_step_down: int = 1
    dry_run: bool = False
    placement: Placement = field(default_factory=Placement)

    def validate(self, where: str = "autoscaler") -> None:
        if not 0 <= self.min_engines <= self.max_engines:
            raise ValueError(f"{where}.min_engines: must be between 0 and max_engines")
        if not 0 <= self.queue_drain < self.queue_up:
            raise ValueError(f"{where}.queue_drain: must be below queue_up (hysteresis)")
        if not 0 < self.utilisation_floor < self.target_utilisation <= 1:
            raise ValueError(f"{where}.utilisation_floor: needs 0 < utilisation_floor < target_utilisation <= 1")
        if self.cooldown_s < self.step_cooldown_s or self.step_cooldown_s < 0:
            raise ValueError(f"{where}.cooldown_s: must be at least step_cooldown_s (and both not negative)")
        if self.down_stable_s < 0:
            raise ValueError(f"{where}.down_stable_s: must not be negative")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError(f"{where}.max_step_up: steps must be at least 1")


@dataclass(frozen=True)
class EngineSignal:
    """One engine as the router sees it now."""

    id: str
    waiting: int = 0
    running: int = 0
    in_flight: int = 0
    """Requests routers have outstanding there (fresher than the engine's own polled counts)."""
    unique_blocks: int = 0
    """Cached blocks no other engine holds: what its loss costs the fleet's cache."""
    price_per_hour: float = 0.0
    managed: bool = True
    """Started by the autoscaler's provider, so it may release it."""
    draining: bool = False
    island: str | None = None

    @property
    def demand(self) -> int:
        return max(self.running + self.waiting, self.in_flight)


@dataclass(frozen=True)
class FleetSignals:
    engines: Sequence[EngineSignal]
    pending: int = 0
    """Engines provisioned but not yet registered."""
    hit_ratio: float | None = None
    ttft_p99_s: float | None = None
    traffic_island: str | None = None
    hot_island: str | None = None


@dataclass(frozen=True)
class Decision:
    at: float
    action: Action
    count: int = 0
    reason: str = ""
    offer: Offer | None = None
    release: tuple[str, ...] = ()
    triggers: dict[str, float | int | None] = field(default_factory=dict)
    dry_run: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"at": self.at, "action": self.action, "count": self.count, "reason": self.reason,
                "offer": self.offer.name if self.offer else None, "release": list(self.release),
                "triggers": self.triggers, "dry_run": self.dry_run}


@dataclass
class CapacityEstimate:
    """Requests one engine runs at once, measured when it is saturated (it has a queue).

    An engine with a queue runs as many requests as it can, so its running count is a sample of its
    capacity; samples fade into the estimate, which starts from the offer's nominal capacity."""

    value: float
    fade: float = 0.8

    def observe(self, engines: Sequence[EngineSignal]) -> None:
        """Fade in the saturated engines' running counts; never stay under a running count seen now (an engine
        running more than the estimate, queue or not, proves the estimate too low)."""
        active = [e for e in engines if not e.draining]
        samples = [e.running for e in active if e.waiting > 0 and e.running > 0]
        if samples:
            sample = sum(samples) / len(samples)
            self.value = max(1.0, self.fade * self.value + (1 - self.fade) * sample)
        self.value = max([self.value, *(e.running for e in active)])


def backlog(engine: EngineSignal, capacity: float) -> float:
    """Requests waiting for a slot on one engine: its demand (polled or in flight from the routers, whichever
    is fresher) beyond its measured capacity.

    Not the polled queue alone: it is up to a poll interval old and misses requests still on their way (in
    the quick benchmark one engine had 3 requests in flight at a capacity of 2 while its polled queue read
    0, and two engines ran at 1.1-1.8 times their capacity for 9 s without a scale-up); and a request that
    arrived between two engine steps reads as waiting while a slot is free (1 waiting, 0 running on an
    engine of 2 slots scaled a quiet fleet up)."""
    return max(0.0, engine.demand - capacity)


class Autoscaler:
    """The decision state: measured capacity and the last change (for cooldowns)."""

    def __init__(self, policy: ScalePolicy, offers: Sequence[Offer]) -> None:
        policy.validate()
        if not offers:
            raise ValueError("autoscaler.offers: at least one offer is needed")
        self.policy = policy
        self.offers = list(offers)
        nominal = min(o.capacity for o in offers)
        self.capacity = CapacityEstimate(nominal)
        self.last_change: tuple[float, Action] | None = None
        self.idle_since: float | None = None

    def decide(self, signals: FleetSignals, now: float) -> Decision:
        p = self.policy
        active = [e for e in signals.engines if not e.draining]
        self.capacity.observe(active)
        fleet = len(active) + signals.pending
        demand = sum(e.demand for e in active)
        capacity = self.capacity.value
        avg_queue = sum(backlog(e, capacity) for e in active) / len(active) if active else 0.0
        utilisation = demand / (len(active) * capacity) if active else (1.0 if demand else 0.0)
        needed = math.ceil(demand / (capacity * p.target_utilisation)) if demand else 0
        triggers = {"fleet": fleet, "pending": signals.pending, "demand": demand, "avg_queue": round(avg_queue, 3),
                    "utilisation": round(utilisation, 3), "capacity": round(capacity, 2), "needed": needed,
                    "hit_ratio": signals.hit_ratio, "ttft_p99_s": signals.ttft_p99_s}

        def decision(action: Action, reason: str, **extra: Any) -> Decision:
            made = Decision(now, action, reason=reason, triggers=triggers, dry_run=p.dry_run, **extra)
            if action != "hold":
                self.last_change = (now, action)
            return made

        if fleet < p.min_engines:
            return self._up(decision, signals, p.min_engines - fleet, "below min_engines", now, force=True)
        up_reason = self._up_reason(avg_queue, utilisation, needed, fleet, signals)
        if up_reason and fleet < p.max_engines:
            return self._up(decision, signals, max(1, needed - fleet), up_reason, now)
        if up_reason:
            return decision("hold", f"{up_reason}, but at max_engines")
        if fleet > p.max_engines:
            return self._down(decision, active, fleet - p.max_engines, "above max_engines", now, force=True)
        surplus = min(p.max_step_down, fleet - max(p.min_engines, needed, 1 if demand else 0))
        if signals.pending == 0 and avg_queue < p.queue_drain and utilisation < p.utilisation_floor and surplus > 0:
            self.idle_since = now if self.idle_since is None else self.idle_since
            if now - self.idle_since < p.down_stable_s:
                return decision("hold", f"idle capacity, for {now - self.idle_since:.1f} s of {p.down_stable_s} s")
            return self._down(decision, active, surplus, "idle capacity", now)
        self.idle_since = None
        return decision("hold", "within bounds")

    def _up_reason(self, avg_queue: float, utilisation: float, needed: int, fleet: int, signals: FleetSignals) -> str:
        """Why the fleet should grow (empty: it should not). Sizing for ``target_utilisation`` before a queue
        forms keeps warm headroom: in the quick benchmark's burst one engine sat at full capacity a second
        before any queue showed."""
        p = self.policy
        if avg_queue > p.queue_up:
            return f"queue depth {avg_queue:.2f} > {p.queue_up}"
        if needed > fleet:
            return f"demand needs {needed} engines at {p.target_utilisation} utilisation, the fleet has {fleet}"
        if signals.ttft_p99_s is not None and signals.ttft_p99_s > p.ttft_p99_ceiling_s:
            return f"ttft p99 {signals.ttft_p99_s:.3f}s > {p.ttft_p99_ceiling_s}s"
        if signals.hit_ratio is not None and signals.hit_ratio < p.hit_ratio_floor and utilisation >= p.saturation:
            return f"hit ratio {signals.hit_ratio:.2f} < {p.hit_ratio_floor} while saturated"
        return ""

    def _cooling(self, action: Action, now: float) -> bool:
        if self.last_change is None:
            return False
        at, last = self.last_change
        wait = self.policy.step_cooldown_s if last == action else self.policy.cooldown_s
        return now - at < wait

    def _up(self, decision, signals: FleetSignals, count: int, reason: str, now: float,
            force: bool = False) -> Decision:
        p = self.policy
        fleet = sum(1 for e in signals.engines if not e.draining) + signals.pending
        count = min(count, p.max_engines - fleet) if force else min(count, p.max_step_up, p.max_engines - fleet)
        if count <= 0:
            return decision("hold", f"{reason}, but no room under max_engines")
        if not force and self._cooling("up", now):
            return decision("hold", f"{reason}, but cooling down")
        offer = choose_offer(self.offers, signals.traffic_island, signals.hot_island, p.placement)
        if offer is None:
            return decision("hold", f"{reason}, but no offer meets the latency limits")
        return decision("up", reason, count=count, offer=offer)

    def _down(self, decision, active: list[EngineSignal], count: int, reason: str, now: float,
              force: bool = False) -> Decision:
        if not force and self._cooling("down", now):
            return decision("hold", f"{reason}, but cooling down")
        release = tuple(e.id for e in release_order(active)[:count])
        if not release:
            return decision("hold", f"{reason}, but no engine is the autoscaler's to release")
        return decision("down", reason, count=len(release), release=release)


def release_order(engines: Sequence[EngineSignal]) -> list[EngineSignal]:
    """Managed engines, cheapest loss first: fewest blocks only they hold, least in flight, dearest."""
    managed = [e for e in engines if e.managed and not e.draining]
    return sorted(managed, key=lambda e: (e.unique_blocks, e.demand, -e.price_per_hour, e.id))
