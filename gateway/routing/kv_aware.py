"""Cache-and-load policies: rank candidates by estimated time to the last token (first token + decode)
plus the recompute their placement causes later (see ``CostModel.eviction_s``).

``kv_aware`` counts the event-fed index (scaled by confidence) plus half-trusted speculative entries;
``approximate`` counts only the router-side speculative entries, like routers that never see engine
events. Ties (within a nanosecond) go to the shorter queue, then to this router's in-flight count,
then to the prefix key's rendezvous order.
"""

from __future__ import annotations

from gateway.routing.base import Policy, Scores
from gateway.routing.cost import Knowledge
from gateway.routing.hashing import key_hash, rendezvous_weight
from gateway.routing.types import CandidateScore, EngineView, RouteRequest

_TIE_DIGITS = 9
# An engine back from being down gets the next request that no engine holds much of: its learned speed
# was forgotten and its cache is cold, so the cost model alone could leave it idle at low load for good
# (peers measured here took ~30 s, or never, to send to a restarted engine again).
REJOIN_PROBE_MAX_CACHED_SHARE = 0.5


def _why_not_the_cache(chosen: CandidateScore, holder: CandidateScore) -> str:
    """Name the term that made a better-cached engine lose."""
    margins = {
        "hot-prefix-spill": holder.queue_s + holder.decode_s - chosen.queue_s - chosen.decode_s,
        "kv-pressure": holder.pressure_penalty_s - chosen.pressure_penalty_s,
        "topology": holder.topology_penalty_s - chosen.topology_penalty_s,
    }
    name, margin = max(margins.items(), key=lambda kv: kv[1])
    return name if margin > 0 else "faster-engine"


def describe(request: RouteRequest, ranked: list[str], scores: Scores) -> str:
    chosen = scores[ranked[0]]
    holder = max(scores.values(), key=lambda s: (s.cached_tokens, -s.cost_s))
    if holder.cached_tokens <= 0:
        return "least-loaded"
    if chosen.cached_tokens >= holder.cached_tokens:
        share = chosen.overlap_tokens / request.prompt_tokens if request.prompt_tokens > 0 else 0.0
        return f"cache-hit {share:.0%}"
    return _why_not_the_cache(chosen, holder)


class KvAwarePolicy(Policy):
    name = "kv_aware"
    knowledge = Knowledge.EVENTS

    def rank(self, request: RouteRequest, pool: list[EngineView], scores: Scores) -> tuple[list[str], str]:
        h = key_hash(request.prefix_key or request.model)

        def order(engine: EngineView) -> tuple[float, int, int, int]:
            score = scores[engine.id]
            return (
                round(score.cost_s, _TIE_DIGITS),
                score.queue_depth,
                max(0, engine.in_flight),
                -rendezvous_weight(h, engine.id),
            )

        ranked = [e.id for e in sorted(pool, key=order)]
        probe = next((e.id for e in pool if e.rejoining and e.id != ranked[0]), None)
        chosen = scores[ranked[0]]
        if probe is not None and chosen.cached_tokens < REJOIN_PROBE_MAX_CACHED_SHARE * request.prompt_tokens:
            return [probe, *(i for i in ranked if i != probe)], "rejoin-probe"
        return ranked, describe(request, ranked, scores)


class ApproximatePolicy(KvAwarePolicy):
    name = "approximate"
    knowledge = Knowledge.ROUTER_ONLY
