"""The autoscaler's view of this replica, through the protocols it owns (``autoscale/ports.py``): the fleet
it may grow and shrink, and the signals it decides on."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Histogram

from autoscale.config import AutoscaleConfig
from autoscale.decision import EngineSignal, FleetSignals
from autoscale.loop import AutoscaleLoop
from autoscale.providers.base import Provider
from autoscale.signals import histogram_quantile
from gateway.config import EngineConfig
from gateway.engines import EngineRegistry
from gateway.fleet import Fleet
from index.view import CacheView

TTFT_METRIC = "kvmesh_time_to_first_byte_seconds"


class FleetAutoscaleControl:
    """``FleetControl`` on this replica's ``Fleet``: what the autoscaler does is done as admin would."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def known(self, engine_id: str) -> bool:
        return self.fleet.engines.get(engine_id) is not None

    def register(self, engine_id: str, url: str, island: str | None) -> None:
        config = EngineConfig(url=url, id=engine_id, island=island)
        config.validate("provisioned engine")
        self.fleet.add(config)

    def release(self, engine_id: str) -> None:
        self.fleet.remove(engine_id)

    def drain(self, engine_id: str, handover_in_s: float) -> None:
        self.fleet.drain(engine_id, True, handover_in_s)

    def undrain(self, engine_id: str) -> None:
        self.fleet.drain(engine_id, False)

    def idle(self, engine_id: str, since: float) -> bool:
        return self.fleet.idle(engine_id, since)


class RouterSignals:
    """``SignalSource`` read from what the router already knows: load per engine (polled waiting/running,
    this replica's and its peers' in-flight requests), the engines' own prefix-cache hit ratios, TTFT p99
    from this replica's TTFT histogram since the last look, and each engine's blocks that no other engine
    holds (from the index)."""

    def __init__(self, engines: EngineRegistry, cache: CacheView, peer_in_flight: Callable[[], dict[str, int]],
                 ttft: Histogram, island: str | None) -> None:
        self.engines = engines
        self.cache = cache
        self.peer_in_flight = peer_in_flight
        self.ttft = ttft
        self.island = island
        self._ttft_before: dict[float, float] = {}

    def ttft_p99(self) -> float | None:
        buckets: Counter[float] = Counter()
        for metric in self.ttft.collect():
            for sample in metric.samples:
                if sample.name == f"{TTFT_METRIC}_bucket":
                    buckets[float(sample.labels["le"])] += sample.value
        before, self._ttft_before = self._ttft_before, dict(buckets)
        return histogram_quantile(0.99, before, buckets)

    def unique_blocks(self) -> dict[str, int]:
        """Per engine, its blocks no other engine holds: kept by the index as blocks change (a scan of the
        index here held the event loop 0.67 s at 2M indexed blocks, every interval)."""
        return self.cache.store.unique_blocks()

    def read(self, managed: Mapping[str, float], draining: set[str], pending: int) -> FleetSignals:
        peers = self.peer_in_flight()
        unique = self.unique_blocks()
        engines, ratios, islands = [], [], Counter()
        for e in self.engines.all():
            engines.append(EngineSignal(
                e.id, waiting=e.load.waiting, running=e.load.running, in_flight=e.in_flight + peers.get(e.id, 0),
                unique_blocks=unique.get(e.id, 0), price_per_hour=managed.get(e.id, 0.0), managed=e.id in managed,
                draining=e.draining or e.maintenance or e.id in draining, island=e.config.island))
            if e.routable and e.load.reuse.measured:
                ratios.append(e.load.reuse.ratio)
            if e.config.island:
                islands[e.config.island] += self.cache.block_count(e.id)
        hot = islands.most_common(1)[0][0] if islands else None
        return FleetSignals(engines, pending=pending, hit_ratio=sum(ratios) / len(ratios) if ratios else None,
                            ttft_p99_s=self.ttft_p99(), traffic_island=self.island, hot_island=hot)


def build_autoscaler(config: AutoscaleConfig, fleet: Fleet, ttft: Histogram, island: str | None, state: Any,
                     me: str, registry: Any, provider: Provider | None = None) -> AutoscaleLoop:
    """The autoscaler of this replica, wired to its fleet and signals (``state``: the mesh's shared state,
    None without a mesh; ``provider``: the configured one when None)."""
    signals = RouterSignals(fleet.engines, fleet.planner.cache, lambda: fleet.planner.peer_in_flight(), ttft,
                            island)
    return AutoscaleLoop(config, FleetAutoscaleControl(fleet), signals, state, me, registry, provider)
