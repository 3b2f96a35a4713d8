"""Cache-and-load policies: rank candidates by estimated time to the last token (first token + decode)
plus the recompute their placement causes later (see ``CostModel.eviction_s``).

``kv_aware`` counts the event-fed index (scaled by confidence) plus half-trusted speculative entries;
``approximate`` counts only the router-side speculative entries, like routers that never see engine
events. Ties (within a nanosecond) go to the shorter queue, then to this router's in-flight count,
then to the prefix key's rendezvous order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from itertools import groupby
from operator import itemgetter

import msgspec

from gateway.routing.base import Policy, Scores
from gateway.routing.cost import CostModel, Knowledge, engine_slots
from gateway.routing.hashing import key_hash, rendezvous_weight
from gateway.routing.homes import HomeBook
from gateway.routing.sessions import SessionBook
from gateway.routing.types import CandidateScore, Decision, EngineView, HomeNote, RouteRequest

_TIE_DIGITS = 9
# An engine back from being down gets the next request that no engine holds much of: its learned speed
# was forgotten and its cache is cold, so the cost model alone could leave it idle at low load for good
# (peers measured here took ~30 s, or never, to send to a restarted engine again).
REJOIN_PROBE_MAX_CACHED_SHARE = 0.5
AGREE_SHARE = 0.1
"""Share of a new prefix's prefill that its placement may give up for agreeing with the other replicas (see
``agreed_order``)."""
AGREE_MIN_S = 0.002
AGREE_LOAD_SLACK = 0.5
AGREE_LOAD_REQUESTS = 2
"""An engine queued up to this many requests and ``AGREE_LOAD_SLACK`` of the pool's mean depth over the mean may
still take a new prefix by rendezvous."""


def session_of(request: RouteRequest) -> str:
    """The conversation a request belongs to, as a digest of its ``prefix_key`` (system prompt and first user turn):
    the same on every replica, and no prompt text in what the mesh shares."""
    return f"{key_hash(request.prefix_key):016x}" if request.prefix_key else ""


def cost_order(request: RouteRequest, pool: list[EngineView], scores: Scores) -> list[str]:
    """``pool``'s ids by cost (within a nanosecond), then queue, then this router's in-flight count, then the prefix
    key's rendezvous order. The rendezvous weights are worked out only for engines still tied after the rest, not for
    every engine of every decision (about 3% of a decision at 256 engines under cProfile), for ties that seldom
    happen."""
    def order(engine: EngineView) -> tuple[float, int, int]:
        score, in_flight = scores[engine.id], engine.in_flight
        return round(score.cost_s, _TIE_DIGITS), score.queue_depth, in_flight if in_flight > 0 else 0

    ranked: list[str] = []
    key_h: int | None = None
    for _, tied in groupby(sorted(((order(e), e.id) for e in pool), key=itemgetter(0)), key=itemgetter(0)):
        ids = [engine_id for _, engine_id in tied]
        if len(ids) > 1:
            key_h = key_hash(request.prefix_key or request.model) if key_h is None else key_h
            ids.sort(key=partial(_heaviest_first, key_h))
        ranked.extend(ids)
    return ranked


def _heaviest_first(key_h: int, engine_id: str) -> int:
    return -rendezvous_weight(key_h, engine_id)


def agreed_order(ranked: list[str], scores: Scores, home_key: str, homes: Collection[str] = ()) -> list[str]:
    """``ranked`` with the engines near the best ordered by ``home_key``'s rendezvous weight, which every replica
    computes alike (for a prefix no engine is known to hold: ``KvAwarePolicy.rank``); a prefix with ``homes`` goes
    to the cheapest of them that is near. A home no engine shows a block of is a peer's placement of a moment ago
    (its dispatched blocks are shared later than its placements): ranked by cost, the prefix's next request went to
    whichever engine was least loaded and was computed there a second time (seed 2 shape #2).

    Near means near in what replicas see alike and not far off in what each sees alone. Alike: the prefill,
    penalties and adapter load there within a tenth of the prefill at stake (``AGREE_SHARE``: a duplicate costs all
    of it), and the homes the prefix would displace (from the placements every replica shares). Alone: its queue, at
    most ``AGREE_LOAD_SLACK`` of the pool's mean depth and two requests over the mean, and the crowding beside its
    homes, at most the pool's mean crowding over the best engine's. A new prefix's first requests reach every
    replica at once, each having placed its own share of the same burst a moment before (placements reach the others
    tens of milliseconds later): within one request's difference, two replicas agreed only when neither had sent
    anything to the rendezvous choice yet (seed 2 shape #2, 60 streams on 10 engines: 14 of 27 prompts computed on
    two or three engines, three replicas 0.76 of the bound against one router's 0.98). An engine whose homes are
    clearly hotter than the others' stays out: the agreement once overrode the crowding term, and new prefixes piled
    onto engines holding hot homes (seed 0 shape #6, one router: 0.58 of the bound)."""
    best = scores[ranked[0]]
    depths = [s.queue_depth for s in scores.values()]
    mean_depth = sum(depths) / len(depths)
    depth_limit = mean_depth + AGREE_LOAD_REQUESTS + AGREE_LOAD_SLACK * mean_depth
    crowding_limit = best.crowding_s + sum(s.crowding_s for s in scores.values()) / len(scores) + AGREE_MIN_S
    homed = best.displacement_s + best.overflow_s + AGREE_MIN_S
    alike = _alike_s(best) + max(AGREE_MIN_S, AGREE_SHARE * best.prefill_s)
    near = [e for e in ranked if _alike_s(s := scores[e]) <= alike and s.displacement_s + s.overflow_s <= homed
            and s.queue_depth <= depth_limit and s.crowding_s <= crowding_limit]
    if homes:
        near_homes = [e for e in near if e in homes]
        return near_homes + [e for e in ranked if e not in near_homes]
    if len(near) < 2:
        return ranked
    h = key_hash(home_key)
    return sorted(near, key=lambda e: -rendezvous_weight(h, e)) + [e for e in ranked if e not in near]


def _alike_s(score: CandidateScore) -> float:
    """The terms of a cost that replicas sharing an index and placements see alike: an engine's speed shows in its
    prefill, and loading the request's LoRA adapter there (or waiting for a slot for it) is the engine's state."""
    return (score.prefill_s + score.pressure_penalty_s + score.topology_penalty_s + score.eviction_s
            + score.adapter_s)


def held_order(ranked: list[str], scores: Scores, deviation: Callable[[str], float],
               decode_doubt: float = 0.0) -> list[str]:
    """``ranked`` with the engine holding most of the prompt first when the cheaper choice would beat it by less
    than one deviation of the holder's learned TTFT (``TTFTLearner.deviation`` times its queue and prefill) plus
    the share of the decode it would save that the decode model's slope does not vouch for (``decode_doubt``,
    ``DecodeModel.slope_doubt``).

    Leaving cached tokens behind is certain loss (the prefix is computed and stored twice, and under KV pressure
    the copy evicts what others would have read); the gain is an estimate. On the suite's pressure shapes the
    spills won by 1-18 ms of 230-330 ms estimates (seed 0 #6: queue and decode one stream deeper against a
    prefill the engine clock made cheap), well inside the TTFTs' own scatter, and cost 5-11k of 68k prompt
    tokens (one router 0.58-0.83 of the bound in four of six runs, smg, which never spilled there, 1.00). A
    holder with a real queue still spills: twelve requests ahead cost far more than one deviation.

    Only a holder of most of the prompt is held to: a chat's first turn that shares just a short system prompt
    goes by cost, and its later turns stay wherever it lands. "Most" counts the blocks the holder is believed to
    hold whether confirmed or sent there (its overlap, not the trust-scaled credit): a sibling arriving while its
    prompt is prefilling sees that engine computing all of it, at a trust of one half, which never made a
    majority. Holding first turns piled agentic sessions onto 2 of 14 engines (seed 2 #1, 0.69-0.78 of the bound
    against 0.84-0.94); ``within_load_limit`` keeps a holder from taking a burst beyond its share."""
    best = scores[ranked[0]]
    holder = max(ranked, key=lambda e: (scores[e].cached_tokens, -scores[e].cost_s))
    held = scores[holder]
    if held.cached_tokens <= best.cached_tokens or 2 * held.overlap_tokens <= held.cached_tokens + held.uncached_tokens:
        return ranked
    tolerance = (deviation(holder) * (held.queue_s + held.prefill_s)
                 + decode_doubt * max(0.0, held.decode_s - best.decode_s))
    if held.cost_s - best.cost_s > tolerance:
        return ranked
    return [holder, *(e for e in ranked if e != holder)]


LOAD_SLACK = 3.0
"""An engine more than this many times the pool's mean queue deep (plus ``LOAD_SLACK_REQUESTS``) goes after the
others (``within_load_limit``); the offline bound plans homes under limits of 1-3x the mean load."""
LOAD_SLACK_REQUESTS = 3


def within_load_limit(ranked: list[str], scores: Scores) -> list[str]:
    """``ranked`` with the engines queued far deeper than the pool's mean moved last (when some are not).

    The cost model prices a request ahead by its learned share of a batch, which at an opening burst (priors, a
    loaded machine) is a fraction of what the prefills ahead take: 13 new agentic sessions sharing a 2.2k-token
    system prompt went to the one engine holding it (seed 2 suite shape #1, estimated 100-130 ms, measured 1.1 s),
    and their growing histories then evicted each other there (0.71-0.82 of the bound, 0.84-0.94 when the
    system prompt's holders were hidden by head-only records; 0.84-0.92 with this limit)."""
    limit = LOAD_SLACK * sum(s.queue_depth for s in scores.values()) / len(scores) + LOAD_SLACK_REQUESTS
    over = [e for e in ranked if scores[e].queue_depth > limit]
    if not over or len(over) == len(ranked):
        return ranked
    return [e for e in ranked if e not in over] + over


def _why_not_the_cache(chosen: CandidateScore, holder: CandidateScore) -> str:
    """Name the term that made a better-cached engine lose."""
    margins = {
        "hot-prefix-spill": holder.queue_s + holder.decode_s - chosen.queue_s - chosen.decode_s,
        "kv-pressure": holder.pressure_penalty_s - chosen.pressure_penalty_s,
        "topology": holder.topology_penalty_s - chosen.topology_penalty_s,
        "history-overflow": holder.overflow_s - chosen.overflow_s,
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
    """Also keeps each prefix's homes (gateway/routing/homes.py): leaving them is charged what it displaces."""

    name = "kv_aware"
    knowledge = Knowledge.EVENTS
    keeps_homes = True

    def __init__(self, costs: CostModel | None = None) -> None:
        super().__init__(costs)
        self.homes = HomeBook()
        self.sessions = SessionBook()
        self.on_placed: Callable[[tuple[str, str, int, int | None, str, int]], None] | None = None
        """Told every placement this replica records (the mesh shares them: ``record_peer_placement``)."""
        self.agree_with_peers = False
        """Place prefixes no engine holds by ``agreed_order`` (set for a meshed replica: a lone router has no one to
        agree with, and ranks them by cost alone)."""

    def _priced_by_homes(self, request: RouteRequest, pool: list[EngineView], scores: Scores) -> None:
        """Price what each placement displaces by the home book (in place of the blind eviction term, which
        ``prices_evictions`` leaves out of the estimates), and charge a prefix without a home the queueing beside
        the heat homed on each engine, relative to the pool's mean (a homed prefix spills by the cost model's own
        queue terms, which already price its home's queue; charging the spill again would only keep hot prefixes
        on queued engines longer). The blind term prices the blocks of prefixes nobody asks for any more like
        those of hot ones: after a change of traffic it sent every new prefix away from the engine whose cache
        happened to be full of old ones.

        Leaving home is also charged the stall its prefill causes the streams decoding where it goes
        (``CostModel.stall_s``); ``decode_s`` charges a request for the batch it joins, and without the mirror
        term a long answer's decode gap (128 tokens at one or two streams' difference: 40-110 ms, learned)
        outweighed a document's prefill: workload d at c=8 spilled 51-55 times in 480 requests, each a near-full
        miss with a worse TTFT of its own (p50 132 ms against 91 ms for a hit at home), hit 0.54-0.56; with the
        stall, 25 spills, hit 0.612/0.581 and TTFT p50 99/104 ms against 116-127. Charged everywhere, the stall
        also moved new prefixes and cost workload e 5 points of hit rate and 25 ms of TTFT p90."""
        key = request.home_key
        homes = self.homes.homes(key)
        heat = {e.id: self.homes.resident_heat(e.id, exclude=key) for e in pool}
        mean_heat = sum(heat.values()) / len(pool)
        session = session_of(request)
        session = session if self.sessions.continues(session) else ""
        for engine in pool:
            params = self.costs.learner.params(engine.id, engine_slots(engine))
            block = max(1, engine.block_size)
            home = engine.id in homes
            displacement = self.homes.displacement_s(
                key, request.total_blocks, engine.id, engine.num_blocks,
                lambda blocks, p=params, b=block: p.prefill_s(blocks * b),
            )
            crowding = 0.0 if homes or mean_heat <= 0 else params.batch_s_per_request * heat[engine.id] / mean_heat
            score = scores[engine.id]
            stall = 0.0 if home or not homes else self.costs.stall_s(
                score.queue_depth, engine.max_num_seqs, score.uncached_tokens, params)
            overflow = 0.0 if not session else self.sessions.overflow_s(
                session, engine.id, request.total_blocks, score.uncached_tokens // block, engine.num_blocks,
                lambda blocks, p=params, b=block: p.prefill_s(blocks * b))
            if home or displacement or crowding or stall or overflow:  # else the estimate's defaults stand: no copy
                scores[engine.id] = msgspec.structs.replace(score, home=home, displacement_s=displacement,
                                                            crowding_s=crowding, stall_s=stall, overflow_s=overflow)

    def prices_evictions(self, request: RouteRequest) -> bool:
        return self.keeps_homes and bool(request.home_key)

    def rank(self, request: RouteRequest, pool: list[EngineView], scores: Scores) -> tuple[list[str], str]:
        if self.prices_evictions(request):
            self._priced_by_homes(request, pool, scores)
        ranked = held_order(cost_order(request, pool, scores), scores, self.costs.learner.deviation,
                            self.costs.decode.slope_doubt())
        if (self.agree_with_peers and request.home_key
                and all(score.overlap_tokens <= 0 for score in scores.values())):
            ranked = agreed_order(ranked, scores, request.home_key, self.homes.homes(request.home_key))
        ranked = within_load_limit(ranked, scores)
        probe = next((e.id for e in pool if e.rejoining and e.id != ranked[0]), None)
        chosen = scores[ranked[0]]
        if probe is not None and chosen.cached_tokens < REJOIN_PROBE_MAX_CACHED_SHARE * request.prompt_tokens:
            return [probe, *(i for i in ranked if i != probe)], "rejoin-probe"
        return ranked, describe(request, ranked, scores)

    def home_note(self, request: RouteRequest, pool: list[EngineView], scores: Scores,
                  ranked: list[str]) -> HomeNote | None:
        if not (self.keeps_homes and request.home_key and ranked):
            return None
        homes = tuple(self.homes.homes(request.home_key))
        live_homes = [scores[e] for e in homes if e in scores]
        left = None
        if live_homes and ranked[0] not in homes:
            best_home = min(live_homes, key=lambda s: s.cost_s)
            left = _why_not_the_cache(scores[ranked[0]], best_home) if best_home.live else "home-not-live"
        elif homes and not live_homes:
            left = "home-not-a-candidate"
        capacity = {e.id: e.num_blocks for e in pool}
        chosen = scores[ranked[0]]
        block = next((e.block_size for e in pool if e.id == chosen.engine), 0)
        return HomeNote(request.home_key, request.total_blocks, homes, self.homes.heat(request.home_key), capacity,
                        left, session_of(request), chosen.overlap_tokens // block if block > 0 else 0)

    def dispatched(self, decision: Decision, engine_id: str) -> None:
        note = decision.home
        if note is not None:
            capacity = note.capacity_blocks.get(engine_id)
            shared = note.shared_blocks if decision.ranked and engine_id == decision.ranked[0] else 0
            self.homes.record(note.key, engine_id, note.blocks, capacity)
            self.sessions.record(note.session, engine_id, note.blocks, shared)
            if self.on_placed is not None:
                self.on_placed((note.key, engine_id, note.blocks, capacity, note.session, shared))

    def record_peer_placement(self, key: str, engine_id: str, blocks: int, capacity_blocks: int | None,
                              session: str = "", shared_blocks: int = 0) -> None:
        """Another replica placed a request of ``key`` on ``engine_id``: heat it here too, so every replica's
        homes, and the crowding and displacement priced from them, are the fleet's rather than its own third.

        Each replica used to see only the requests its balancer gave it; their home books differed, so a new
        prefix's first requests, reaching several replicas at once, met different crowding terms (up to ~26 ms
        on 13 engines after 6 warm-up requests, more than ``agreed_order`` tolerates) and were placed apart. The
        conversation it continues (``session``, a digest) counts on that engine as it would here: a balancer spreads
        one conversation's turns over the replicas, and each would otherwise see a third of its histories."""
        self.homes.record(key, engine_id, blocks, capacity_blocks)
        self.sessions.record(session, engine_id, blocks, shared_blocks)

    def forget_engine(self, engine_id: str) -> None:
        self.homes.forget_engine(engine_id)
        self.sessions.forget_engine(engine_id)


class ApproximatePolicy(KvAwarePolicy):
    """Keeps no homes: it stands for routers that only know what they sent."""

    name = "approximate"
    knowledge = Knowledge.ROUTER_ONLY
    keeps_homes = False
