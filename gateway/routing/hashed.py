"""Key-affinity policies: rendezvous hashing on the prefix key or on the session key."""

from __future__ import annotations

from gateway.routing.base import Policy, Scores, load_order
from gateway.routing.hashing import rendezvous_order
from gateway.routing.types import EngineView, RouteRequest


class PrefixHashPolicy(Policy):
    """The routing key of a published production proxy (model + first 256 chars of system and first user
    message, FNV-1a 64 + fmix64) ranked by rendezvous hashing over the candidates."""

    name = "prefix_hash"

    def rank(self, request: RouteRequest, pool: list[EngineView], scores: Scores) -> tuple[list[str], str]:
        return rendezvous_order(request.prefix_key or request.model, (e.id for e in pool)), "prefix-hash"


class SessionPolicy(Policy):
    """Sticks a session to one engine; requests without a session key go to the least loaded."""

    name = "session"

    def rank(self, request: RouteRequest, pool: list[EngineView], scores: Scores) -> tuple[list[str], str]:
        if not request.session_key:
            return load_order(request, pool), "least-loaded (no session)"
        return rendezvous_order(request.session_key, (e.id for e in pool)), "session-sticky"
