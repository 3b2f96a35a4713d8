"""What the router already knows, as the decision core's ``FleetSignals``.

Load per engine (polled waiting/running, this replica's and its peers' in-flight requests), the engines'
own prefix-cache hit ratios (from their counters), TTFT p99 from this replica's TTFT histogram since the
last look, and each engine's blocks that no other engine holds (from the index).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from autoscale.decision import EngineSignal, FleetSignals

if TYPE_CHECKING:
    from gateway.router import Router

TTFT_METRIC = "kvmesh_time_to_first_byte_seconds"


def histogram_quantile(q: float, before: Mapping[float, float], after: Mapping[float, float]) -> float | None:
    """Quantile ``q`` of the observations between two snapshots of cumulative buckets (upper bound ->
    count), interpolated inside the bucket as Prometheus does; None without observations."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, count
    return lower


class SignalReader:
    """Reads a router's state into signals; remembers the last TTFT histogram to take differences."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._ttft_before: dict[float, float] = {}

    def ttft_p99(self) -> float | None:
        buckets: Counter[float] = Counter()
        for metric in self.router.metrics.ttft.collect():
            for sample in metric.samples:
                if sample.name == f"{TTFT_METRIC}_bucket":
                    buckets[float(sample.labels["le"])] += sample.value
        before, self._ttft_before = self._ttft_before, dict(buckets)
        return histogram_quantile(0.99, before, buckets)

    def unique_blocks(self) -> dict[str, int]:
        """Per engine, its blocks no other engine holds: kept by the index as blocks change (a scan of the
        index here held the event loop 0.67 s at 2M indexed blocks, every interval)."""
        return self.router.planner.cache.store.unique_blocks()

    def read(self, managed: Mapping[str, float], draining: set[str], pending: int) -> FleetSignals:
        """``managed``: engines the autoscaler may release, with their price per hour."""
        router = self.router
        peers = router.planner.peer_in_flight()
        unique = self.unique_blocks()
        engines, ratios, islands = [], [], Counter()
        for e in router.engines.all():
            engines.append(EngineSignal(
                e.id, waiting=e.load.waiting, running=e.load.running, in_flight=e.in_flight + peers.get(e.id, 0),
                unique_blocks=unique.get(e.id, 0), price_per_hour=managed.get(e.id, 0.0), managed=e.id in managed,
                draining=e.draining or e.maintenance or e.id in draining, island=e.config.island))
            if e.routable and e.load.reuse.measured:
                ratios.append(e.load.reuse.ratio)
            if e.config.island:
                islands[e.config.island] += router.planner.cache.block_count(e.id)
        hot = islands.most_common(1)[0][0] if islands else None
        return FleetSignals(engines, pending=pending, hit_ratio=sum(ratios) / len(ratios) if ratios else None,
                            ttft_p99_s=self.ttft_p99(), traffic_island=router.config.island, hot_island=hot)
