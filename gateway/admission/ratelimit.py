"""Per-tenant rate limits that hold across all router replicas (sans-IO; ``now`` is wall-clock seconds).

Two limits per tenant, each checked twice:

1. Locally, a token bucket (rate = the limit, capacity = ``*_burst_s`` worth) shapes this replica's bursts.
2. Cluster-wide, a sliding window of ``slots`` fixed slots (absolute slot index ``floor(now / slot_s)``,
   so every replica means the same slots; clocks must agree to well under one slot, as NTP gives). Each
   replica counts what it admitted per slot and publishes those counts (``export``); it reads the peers'
   (``merge_peer_counts``). A request is admitted when

       own_window + cost <= (limit * window_s - fresh_peers_window) / (1 + stale_peers)

   With every peer fresh this is simply "cluster total stays under the budget". A peer whose counts are
   older than ``peer_stale_after_s`` (mesh cut off, or the peer stopped publishing) is assumed to use an
   equal share of what is left; with every peer stale a replica gets ``limit / N_live``. Chosen over the
   full local bucket because during a partition the L4 balancer keeps spreading a tenant's traffic over
   both sides, and N full buckets would let the tenant run at N times its limit; the cost is that a
   tenant whose traffic all lands on the cut-off replica gets 1/N until the mesh heals. A peer silent for
   ``peer_forget_after_s`` is presumed dead and forgotten (its share returns), as is one the membership
   reports gone (``forget_peer``).

Slack: a peer's counts arrive up to ``d`` seconds late (publish interval + replication lag), so the
admissions a replica has not seen are those its peers made in their last ``d`` seconds, which their local
buckets cap at ``rate * d + burst`` each. Over any slot-aligned window the cluster therefore admits at
most ``limit * window_s + (N - 1) * (rate * d + burst)``; publish often (every 0.2-0.5 s) to keep d small.

Prompt tokens are charged when the request is admitted (the router knows them after tokenizing); a
request larger than a limit's budget can never pass and gets ``Reject(None, ...)`` (no Retry-After).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.admission.config import AdmissionConfig
from gateway.admission.decision import ADMIT, Decision, Reject
from gateway.admission.token_bucket import TokenBucket
from gateway.security.auth import Tenant

PAYLOAD_VERSION = 1
REQUESTS = "requests_per_second"
TOKENS = "prompt_tokens_per_minute"
_WIRE = {REQUESTS: "req", TOKENS: "tok"}
_MAX_PEER_TENANTS = 10_000


@dataclass(frozen=True, slots=True)
class Window:
    """Slot geometry of one limit's cluster window; replicas must agree on it to compare counts."""

    slot_s: float
    slots: int

    @property
    def length_s(self) -> float:
        return self.slot_s * self.slots

    def current(self, now: float) -> int:
        return math.floor(now / self.slot_s)

    def indices(self, now: float) -> range:
        """Slot indices inside the window at ``now``, oldest first."""
        cur = self.current(now)
        return range(cur - self.slots + 1, cur + 1)


@dataclass
class _Dimension:
    rate: float
    bucket: TokenBucket
    counts: dict[int, float] = field(default_factory=dict)


@dataclass
class _TenantState:
    limits: tuple[float | None, float | None]
    dims: dict[str, _Dimension]


@dataclass
class _Peer:
    received_at: float
    sent_at: float
    tenants: dict[str, dict[str, dict[int, float]]]


class RateLimiter:
    def __init__(self, replica_id: str, config: AdmissionConfig | None = None) -> None:
        config = config or AdmissionConfig()
        self.replica_id = replica_id
        self.config = config
        self.windows = {
            REQUESTS: Window(config.request_window_s / config.request_slots, config.request_slots),
            TOKENS: Window(config.token_window_s / config.token_slots, config.token_slots),
        }
        self._burst_s = {REQUESTS: config.request_burst_s, TOKENS: config.token_burst_s}
        self._tenants: dict[str, _TenantState] = {}
        self._peers: dict[str, _Peer] = {}
        self.malformed = 0

    def admit(self, tenant: Tenant, now: float, prompt_tokens: int = 0) -> Decision:
        """Charge one request and ``prompt_tokens`` if both limits allow it; otherwise charge nothing."""
        return self._decide(tenant, now, float(max(0, prompt_tokens)), charge=True)

    def check(self, tenant: Tenant, now: float) -> Decision:
        """Whether the smallest request (one request, one prompt token) fits now; charges nothing.

        For the router to call before the costly part of a request (tokenizing it): a tenant flooding far
        above its limit is then turned away without using the tokenizer capacity all tenants share.
        ``admit`` remains the authoritative, charging check.
        """
        return self._decide(tenant, now, 1.0, charge=False)

    def _decide(self, tenant: Tenant, now: float, prompt_tokens: float, charge: bool) -> Decision:
        state = self._state(tenant, now)
        if state is None:
            return ADMIT
        self._prune_peers(now)
        costs = {REQUESTS: 1.0, TOKENS: prompt_tokens}
        waits: dict[str, float | None] = {}
        for name, dim in state.dims.items():
            if costs[name] > 0:
                waits[name] = self._wait(tenant.name, name, dim, costs[name], now)
        blocked = {name: wait for name, wait in waits.items() if wait != 0.0}
        if blocked:
            reason = ", ".join(f"{name} of tenant {tenant.name}" for name in blocked)
            if any(wait is None for wait in blocked.values()):
                return Reject(None, f"request exceeds {reason}")
            return Reject(max(w for w in blocked.values() if w is not None), reason)
        if not charge:
            return ADMIT
        for name in waits:
            dim = state.dims[name]
            dim.bucket.take(costs[name], now)
            slot = self.windows[name].current(now)
            if slot not in dim.counts:
                _drop_before(dim.counts, self.windows[name].indices(now).start)
            dim.counts[slot] = dim.counts.get(slot, 0.0) + costs[name]
        return ADMIT

    def _state(self, tenant: Tenant, now: float) -> _TenantState | None:
        limits = (tenant.requests_per_second, tenant.prompt_tokens_per_minute)
        if limits == (None, None):
            return None
        state = self._tenants.get(tenant.name)
        if state is None or state.limits != limits:
            dims = {}
            per_second = (limits[0], None if limits[1] is None else limits[1] / 60)
            for name, limit in zip((REQUESTS, TOKENS), per_second, strict=True):
                if limit is not None:
                    capacity = max(1.0, limit * self._burst_s[name])
                    dims[name] = _Dimension(limit, TokenBucket.full(limit, capacity, now))
            state = self._tenants[tenant.name] = _TenantState(limits, dims)
        return state

    def _wait(self, tenant: str, name: str, dim: _Dimension, cost: float, now: float) -> float | None:
        window = self.windows[name]
        budget = dim.rate * window.length_s
        local = dim.bucket.wait_time(cost, now)
        if local is None or cost > budget:
            return None
        slots = window.indices(now)
        peers: list[dict[int, float]] = []
        stale = 0
        for peer in self._peers.values():
            if self._fresh(peer, now):
                peers.append(peer.tenants.get(tenant, {}).get(name, {}))
            else:
                stale += 1
        # Fast path (the common case): the totals fit, no need to look at slots one by one.
        fresh_total = sum(_window_total(counts, slots) for counts in peers)
        if _window_total(dim.counts, slots) + cost <= (budget - fresh_total) / (1 + stale):
            return local
        own = [dim.counts.get(i, 0.0) for i in slots]
        fresh = [sum(counts.get(i, 0.0) for counts in peers) for i in slots]
        return max(local, self._cluster_wait(own, fresh, stale, cost, budget, window, now))

    @staticmethod
    def _cluster_wait(own: list[float], fresh: list[float], stale: int, cost: float, budget: float,
                      window: Window, now: float) -> float:
        """Seconds until enough old slots leave the window for ``cost`` to fit in this replica's share."""
        cur = window.current(now)
        for k in range(1, len(own) + 1):
            if sum(own[k:]) + cost <= (budget - sum(fresh[k:])) / (1 + stale):
                return max(0.0, (cur + k) * window.slot_s - now)
        return window.length_s

    def _fresh(self, peer: _Peer, now: float) -> bool:
        limit = self.config.peer_stale_after_s
        return now - peer.received_at <= limit and abs(now - peer.sent_at) <= limit

    def _prune_peers(self, now: float) -> None:
        forget = self.config.peer_forget_after_s
        for replica in [r for r, p in self._peers.items() if now - p.received_at > forget]:
            del self._peers[replica]

    def export(self, now: float) -> dict[str, Any]:
        """This replica's counts inside the windows, for the mesh document (JSON-serialisable).

        Shape: ``{"v": 1, "at": now, "windows": {"req": [slot_s, slots], "tok": [slot_s, slots]},
        "tenants": {name: {"req": {"first": slot, "counts": [...]}, "tok": {...}}}}``; publish it even when
        no tenant has counts: it doubles as the heartbeat that keeps this replica's share fresh on peers.
        """
        tenants: dict[str, dict[str, Any]] = {}
        for tenant, state in self._tenants.items():
            entry = {}
            for name, dim in state.dims.items():
                slots = self.windows[name].indices(now)
                _drop_before(dim.counts, slots.start)
                counts = [dim.counts.get(i, 0.0) for i in slots]
                if any(counts):
                    entry[_WIRE[name]] = {"first": slots.start, "counts": counts}
            if entry:
                tenants[tenant] = entry
        windows = {_WIRE[name]: [w.slot_s, w.slots] for name, w in self.windows.items()}
        return {"v": PAYLOAD_VERSION, "at": now, "windows": windows, "tenants": tenants}

    def merge_peer_counts(self, replica_id: str, payload: Any, now: float) -> bool:
        """Take a peer's latest published counts; malformed or foreign-geometry payloads are counted and
        dropped. Returns whether the payload was used."""
        if replica_id == self.replica_id:
            return False
        peer = self._parse(payload, now)
        if peer is None:
            self.malformed += 1
            return False
        known = self._peers.get(replica_id)
        if known is not None and peer.sent_at < known.sent_at:
            return False
        self._peers[replica_id] = peer
        return True

    def forget_peer(self, replica_id: str) -> None:
        """The membership says this replica is gone: its share of every budget returns to the others."""
        self._peers.pop(replica_id, None)

    def peer_ids(self) -> list[str]:
        """Replicas whose counts this limiter holds (fresh or stale)."""
        return list(self._peers)

    def _parse(self, payload: Any, now: float) -> _Peer | None:
        if not isinstance(payload, dict) or payload.get("v") != PAYLOAD_VERSION:
            return None
        sent_at = payload.get("at")
        if not _finite(sent_at):
            return None
        expected = {_WIRE[name]: [w.slot_s, w.slots] for name, w in self.windows.items()}
        if payload.get("windows") != expected:
            return None
        raw_tenants = payload.get("tenants")
        if not isinstance(raw_tenants, dict) or len(raw_tenants) > _MAX_PEER_TENANTS:
            return None
        wire_to_name = {wire: name for name, wire in _WIRE.items()}
        tenants: dict[str, dict[str, dict[int, float]]] = {}
        for tenant, entry in raw_tenants.items():
            if not isinstance(tenant, str) or not isinstance(entry, dict):
                return None
            dims: dict[str, dict[int, float]] = {}
            for wire, series in entry.items():
                name = wire_to_name.get(wire)
                if name is None:
                    return None
                counts = _parse_series(series, self.windows[name].slots)
                if counts is None:
                    return None
                dims[name] = counts
            tenants[tenant] = dims
        return _Peer(now, float(sent_at), tenants)


def _window_total(counts: dict[int, float], slots: range) -> float:
    return sum(value for slot, value in counts.items() if slot in slots)


def _drop_before(counts: dict[int, float], first: int) -> None:
    for old in [i for i in counts if i < first]:
        del counts[old]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _parse_series(series: Any, slots: int) -> dict[int, float] | None:
    if not isinstance(series, dict):
        return None
    first, counts = series.get("first"), series.get("counts")
    if not isinstance(first, int) or isinstance(first, bool):
        return None
    if not isinstance(counts, list) or len(counts) > slots:
        return None
    if not all(_finite(c) and c >= 0 for c in counts):
        return None
    return {first + k: float(c) for k, c in enumerate(counts) if c}
