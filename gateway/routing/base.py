"""What every policy shares: candidate selection, the explanation table, and TTFT feedback.

Candidates: engines that are healthy and not draining. Only when none exists does a decision fall back
to the others, draining-but-healthy first, then unhealthy ones (a health view can be stale, and trying
costs less than refusing); such decisions say ``no-live-engine`` in their reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from gateway.routing.cost import CostModel, Knowledge
from gateway.routing.hashing import key_hash, rendezvous_weight
from gateway.routing.types import CandidateScore, Decision, EngineView, HomeNote, RouteRequest

Scores = dict[str, CandidateScore]


def candidates(engines: Sequence[EngineView]) -> tuple[list[EngineView], bool]:
    """The engines to rank (first view of each id wins) and whether they are live ones."""
    seen: set[str] = set()
    unique = [e for e in engines if not (e.id in seen or seen.add(e.id))]
    live = [e for e in unique if e.live]
    if live:
        return live, True
    return [e for e in unique if e.healthy] + [e for e in unique if not e.healthy], False


def load_order(request: RouteRequest, pool: Sequence[EngineView]) -> list[str]:
    """Least loaded first: this router's in-flight count, then the engine's running + waiting.

    Exact ties go to the prefix key's rendezvous order, so idle engines still give a prefix a stable home.
    """
    h = key_hash(request.prefix_key or request.model)
    ordered = sorted(
        pool,
        key=lambda e: (max(0, e.in_flight), max(0, e.running) + max(0, e.waiting), -rendezvous_weight(h, e.id)),
    )
    return [e.id for e in ordered]


class Policy(ABC):
    """``choose`` ranks engines for one request; ``observe`` feeds measured TTFTs back to the cost model.

    Every policy fills the same explanation table from the shared cost model, so policies can be compared
    request by request and switching policy keeps what was learned.
    """

    name: str = ""
    knowledge: Knowledge = Knowledge.EVENTS

    def __init__(self, costs: CostModel | None = None) -> None:
        self.costs = costs or CostModel()

    def choose(self, request: RouteRequest, engines: Sequence[EngineView]) -> Decision:
        pool, live = candidates(engines)
        if not pool:
            return Decision([], [], "no-engine", self.name, request.prompt_tokens)
        self.costs.prepare(pool)
        scores = self.costs.estimate_all(request, pool, self.knowledge,
                                         blind_eviction=not self.prices_evictions(request))
        ranked, reason = self.rank(request, pool, scores)
        if not live:
            healthy = {e.id for e in pool if e.healthy}
            ranked = [i for i in ranked if i in healthy] + [i for i in ranked if i not in healthy]
            reason = f"{reason}; no-live-engine"
        home = self.home_note(request, pool, scores, ranked)
        return Decision(ranked, [scores[i] for i in ranked], reason, self.name, request.prompt_tokens, home)

    def prices_evictions(self, request: RouteRequest) -> bool:
        """Whether ``rank`` prices what ``request`` evicts itself, replacing the cost model's blind ``eviction_s``
        (which is then not worked out at all)."""
        return False

    def home_note(self, request: RouteRequest, pool: list[EngineView], scores: Scores,
                  ranked: list[str]) -> HomeNote | None:
        """Where the request's prefix lives, for policies that keep homes (none by default)."""
        return None

    def dispatched(self, decision: Decision, engine_id: str) -> None:  # noqa: B027 - an optional hook
        """The request of ``decision`` was sent to ``engine_id`` (a ``/debug/route`` decision never is)."""

    def forget_engine(self, engine_id: str) -> None:  # noqa: B027 - an optional hook
        """An engine came back empty or left: forget what was placed on it."""

    def observe(self, engine_id: str, uncached_tokens: int, queue_depth: int, ttft_s: float) -> bool:
        """Record one measured TTFT; False if the values were impossible (counted and dropped)."""
        return self.costs.learner.observe(engine_id, uncached_tokens, queue_depth, ttft_s)

    def observe_decode(self, engine_id: str, queue_depth: int, output_tokens: int, decode_s: float) -> bool:
        """Record one finished stream's decoding (tokens after the first, and how long they took)."""
        return self.costs.decode.observe(engine_id, queue_depth, output_tokens, decode_s)

    @abstractmethod
    def rank(self, request: RouteRequest, pool: list[EngineView], scores: Scores) -> tuple[list[str], str]:
        """Order ``pool`` (non-empty, unique ids) best first and say why."""
