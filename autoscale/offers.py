"""The catalogue of engines one can buy, and which offer a scale-up takes or a scale-down gives back.

Pure functions over plain data, so placement can be tested without a cloud.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Offer:
    """One kind of engine a provider can start: where, on what, at what price, how big, how fast."""

    name: str
    island: str = ""
    gpu: str = ""
    price_per_hour: float = 1.0
    capacity: float = 8.0
    """Requests one engine serves at once without queueing (a prior until the loop measures it)."""
    provisioning_s: float = 60.0
    """From the provision call to a healthy engine."""

    def validate(self, where: str) -> None:
        if not self.name:
            raise ValueError(f"{where}.name: must not be empty")
        if self.price_per_hour < 0:
            raise ValueError(f"{where}.price_per_hour: must not be negative")
        if self.capacity <= 0:
            raise ValueError(f"{where}.capacity: must be positive")
        if self.provisioning_s < 0:
            raise ValueError(f"{where}.provisioning_s: must not be negative")


@dataclass(frozen=True)
class Placement:
    """How far the traffic may be from a new engine, and how long it may wait for it."""

    latency_limit_ms: float = 100.0
    """Network latency from the traffic's island an offer must stay within."""
    cross_island_ms: float = 50.0
    """Latency between two different islands (the same island counts as 0)."""
    provisioning_limit_s: float = 600.0
    """Offers slower to start than this cannot help with the demand at hand."""


def latency_ms(offer: Offer, traffic_island: str | None, placement: Placement) -> float:
    if not traffic_island or not offer.island or offer.island == traffic_island:
        return 0.0
    return placement.cross_island_ms


def choose_offer(offers: Sequence[Offer], traffic_island: str | None, hot_island: str | None,
                 placement: Placement) -> Offer | None:
    """The cheapest offer (per unit of capacity) within the latency limits, the hot prefixes' island first.

    Engines next to the hot prefixes can be warmed from their neighbours and serve the requests that
    share those prefixes, so that island wins over a cheaper one elsewhere; the name breaks exact ties
    so the choice is deterministic."""
    fitting = [o for o in offers
               if latency_ms(o, traffic_island, placement) <= placement.latency_limit_ms
               and o.provisioning_s <= placement.provisioning_limit_s]
    if not fitting:
        return None
    return min(fitting, key=lambda o: (bool(hot_island) and o.island != hot_island,
                                       o.price_per_hour / o.capacity, o.provisioning_s, o.name))
