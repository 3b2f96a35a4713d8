"""Policies by name, as ``--policy NAME`` selects them."""

from __future__ import annotations

import random

from gateway.routing.balance import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy
from gateway.routing.base import Policy
from gateway.routing.cost import CostModel
from gateway.routing.hashed import PrefixHashPolicy, SessionPolicy
from gateway.routing.kv_aware import ApproximatePolicy, KvAwarePolicy

DEFAULT_POLICY = "kv_aware"
_SIMPLE: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (KvAwarePolicy, ApproximatePolicy, PrefixHashPolicy, SessionPolicy, LeastLoadedPolicy, RoundRobinPolicy)
}
POLICY_NAMES: tuple[str, ...] = (*_SIMPLE, RandomPolicy.name)


def make_policy(name: str, *, costs: CostModel | None = None, rng: random.Random | None = None) -> Policy:
    """Build a policy; ``rng`` only matters to ``random``. Unknown names raise ValueError listing the choices."""
    if name == RandomPolicy.name:
        return RandomPolicy(costs, rng)
    cls = _SIMPLE.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return cls(costs)
