"""Load-only baselines: least loaded, round robin, random. They ignore the cache on purpose."""

from __future__ import annotations

import random

from gateway.routing.base import Policy, Scores, load_order
from gateway.routing.cost import CostModel
from gateway.routing.types import EngineView, RouteRequest


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def rank(self, request: RouteRequest, pool: list[EngineView], scores: Scores) -> tuple[list[str], str]:
        return load_order(request, pool), "least-loaded"


class RoundRobinPolicy(Policy):
    """Rotates over the candidates sorted by id, so the order engines are listed in does not matter."""

    name = "round_robin"

    def __init__(self, costs: CostModel | None = None) -> None:
        super().__init__(costs)
        self._turn = 0

    def rank(self, request: RouteRequest, pool: list[EngineView], scores: Scores) -> tuple[list[str], str]:
        ids = sorted(e.id for e in pool)
        start = self._turn % len(ids)
        self._turn += 1
        return ids[start:] + ids[:start], "round-robin"


class RandomPolicy(Policy):
    """Uniform random order from an injected generator (seed it for reproducible runs)."""

    name = "random"

    def __init__(self, costs: CostModel | None = None, rng: random.Random | None = None) -> None:
        super().__init__(costs)
        self.rng = rng or random.Random()

    def rank(self, request: RouteRequest, pool: list[EngineView], scores: Scores) -> tuple[list[str], str]:
        ids = sorted(e.id for e in pool)
        self.rng.shuffle(ids)
        return ids, "random"
