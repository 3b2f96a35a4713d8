"""The sans-IO routing core: choose an engine for a request from immutable views, learn from TTFTs."""

from gateway.routing.base import Policy
from gateway.routing.cost import CostModel, CostSettings, queue_depth
from gateway.routing.explain import public_engine_name, route_header, route_table
from gateway.routing.hashing import prefix_key
from gateway.routing.learning import TTFTPrior
from gateway.routing.registry import DEFAULT_POLICY, POLICY_NAMES, make_policy
from gateway.routing.types import CandidateScore, Decision, EngineView, RouteRequest

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "CandidateScore",
    "CostModel",
    "CostSettings",
    "Decision",
    "EngineView",
    "Policy",
    "RouteRequest",
    "TTFTPrior",
    "make_policy",
    "prefix_key",
    "queue_depth",
    "public_engine_name",
    "route_header",
    "route_table",
]
