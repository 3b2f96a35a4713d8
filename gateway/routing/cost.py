"""The cost model: each candidate's estimated time to first token, in seconds.

ttft = queue delay (requests ahead, learned per engine) + overhead + prefill of the tokens the engine
does not already hold (overlap times the trust in that knowledge) + penalties for KV memory pressure
and for leaving the router's island; candidates are ranked by ttft plus the request's own decode time
at the engine's batch size (gateway/routing/decode.py), so load counts even where it hardly delays the
first token. Everything is in seconds, so cache reuse and load trade against
each other without a balance threshold: a hot prefix stays on its holder until the holder's queue costs
more than recomputing the prefix elsewhere, and then it spills. When caches are full, recomputing
elsewhere also evicts what later requests would have read there; that expected recompute is added to
the ranking too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from gateway.routing.decode import DecodeModel, DecodePrior
from gateway.routing.learning import TTFTLearner, TTFTParams, TTFTPrior, split_depth
from gateway.routing.stream_ends import decoding_depth
from gateway.routing.types import CandidateScore, EngineView, RouteRequest


class Knowledge(Enum):
    """Which cache knowledge a policy counts as overlap."""

    EVENTS = "events"
    ROUTER_ONLY = "router_only"


@dataclass(frozen=True, slots=True)
class CostSettings:
    """``approx_trust``: credit for speculative blocks beyond the confirmed ones (the request that put them
    there may still be prefilling, or they may already be evicted). ``cross_island_s``: what leaving the
    router's island costs beyond the latency the engine's learned overhead already measures (shared
    inter-island links, a wider failure domain)."""

    approx_trust: float = 0.5
    cross_island_s: float = 0.010


def _clamp(value: float, low: float, high: float) -> float:
    if not math.isfinite(value):
        return low
    return low if value < low else high if value > high else value


MAX_COUNT = 2**40
"""No real engine or request counts blocks, tokens or requests beyond this. Counts are clamped to it
where they meet float arithmetic, which an int of 309 digits (an engine claiming 1e308 blocks) would
otherwise overflow, failing every decision that engine takes part in."""
MAX_BLOCK_SIZE = 2**16


def _count(value: int, high: int = MAX_COUNT) -> int:
    """``value`` clamped to 0..high. Comparisons, not ``min``/``max`` calls: a decision clamps every engine's counts
    a dozen times, and the two calls took 14% of the scoring's py-spy samples at 256 engines."""
    return 0 if not value > 0 else high if value > high else value


def engine_slots(engine: EngineView) -> int | None:
    """The engine's batch slots as its TTFT model takes them (clamped; None: unknown)."""
    return None if engine.max_num_seqs is None else _count(engine.max_num_seqs)


def _block_size(engine: EngineView) -> int:
    size = _count(engine.block_size, MAX_BLOCK_SIZE)
    return size if size > 1 else 1


def _max_tokens(request: RouteRequest) -> int | None:
    return None if request.max_tokens is None else _count(request.max_tokens)


def queue_depth(engine: EngineView) -> int:
    """Requests ahead of a new one on this engine.

    ``in_flight`` is this router's fresh count, ``peer_in_flight`` the other replicas' (a report old);
    ``running`` is everyone's, one poll old. Taking the larger of the two and adding the engine's waiting
    queue makes the estimate rise with every request any replica dispatches between polls (so a hot
    prefix spills, and replicas do not all pick the engine that looked idle at the last poll) without
    ignoring traffic outside the mesh. The requests of this router that finished since the poll are no
    longer ahead of anyone.
    """
    routed = _count(engine.in_flight) + _count(engine.peer_in_flight)
    polled = engine.running - _count(engine.finished_since_poll)
    return _count((polled if polled > routed else routed) + _count(engine.waiting))


def overlaps(engine: EngineView, prompt: int, knowledge: Knowledge) -> tuple[int, int, int]:
    """Leading tokens of a ``prompt`` tokens long (clamped) the engine holds: in its GPU cache by its events, with
    its offloaded tiers after them, and by the router's record of what it sent there (once per candidate)."""
    block = _block_size(engine)
    exact = _within(engine.exact_blocks * block, prompt)
    tiers = tier_blocks(engine, knowledge)
    tiered = _within((engine.exact_blocks + tiers) * block, prompt) if tiers else exact
    return exact, tiered, _within(engine.approx_blocks * block, prompt)


def _within(tokens: int, prompt: int) -> int:
    """``tokens`` clamped to 0..``prompt`` (``max(0, min(prompt, tokens))`` without the two calls: see ``_count``)."""
    tokens = tokens if tokens < prompt else prompt
    return tokens if tokens > 0 else 0


def tier_blocks(engine: EngineView, knowledge: Knowledge) -> int:
    """Blocks past the GPU prefix an offloaded tier holds: only events tell (the router's record cannot)."""
    if knowledge is not Knowledge.EVENTS or not engine.tier_runs:
        return 0
    return _count(sum(blocks for _, blocks, _ in engine.tier_runs))


def tier_load_s(engine: EngineView, prompt: int, knowledge: Knowledge) -> float:
    """Time to load a ``prompt`` tokens long prompt's blocks held in lower tiers back into the engine's KV cache."""
    if knowledge is not Knowledge.EVENTS or not engine.tier_runs:
        return 0.0
    left = prompt // _block_size(engine) - _count(engine.exact_blocks)
    total = 0.0
    for _, blocks, per_block_s in engine.tier_runs:
        used = min(_count(blocks), max(0, left))
        total += used * _clamp(per_block_s, 0.0, 1.0)
        left -= used
    return total


@dataclass(frozen=True, slots=True)
class _RequestTerms:
    """What the request alone puts into every engine's estimate, worked out once per decision."""

    prompt: int
    """Prompt tokens, clamped."""
    max_tokens: int | None
    """Its answer cap, clamped (None: not given)."""
    answer: float
    """Tokens it is expected to answer (``DecodeModel.expected_output_tokens``)."""
    after_first: float
    """Of those, the ones decoded after its first."""


class CostModel:
    """Estimates candidates with per-engine parameters from ``learner``; holds no I/O and no clock."""

    def __init__(self, settings: CostSettings | None = None, prior: TTFTPrior | None = None,
                 decode_prior: DecodePrior | None = None) -> None:
        self.settings = settings or CostSettings()
        self.learner = TTFTLearner(prior)
        self.decode = DecodeModel(decode_prior or DecodePrior())

    def prepare(self, engines: Sequence[EngineView]) -> None:
        """Before a decision scores its engines: each has its TTFT model and slots, so a fleet fit the new ones
        make due happens before the first is scored, and every engine is scored on the same fit."""
        self.learner.prepare((e.id, engine_slots(e)) for e in engines)

    def credited(self, engine: EngineView, tiered: int, approx: int, knowledge: Knowledge) -> tuple[float, float]:
        """(tokens the model credits as cached, the trust applied) for one candidate, from its ``overlaps``."""
        if knowledge is Knowledge.ROUTER_ONLY:
            return float(approx), 1.0
        confidence = _clamp(engine.confidence, 0.0, 1.0)
        beyond = approx - tiered
        credited = tiered + self.settings.approx_trust * (beyond if beyond > 0 else 0)
        return confidence * credited, confidence

    @staticmethod
    def pressure_penalty_s(engine: EngineView, max_tokens: int | None, uncached: int, p: TTFTParams) -> float:
        """Recompute cost of the tokens (the uncached prompt and up to ``max_tokens`` answer tokens, clamped; none when
        not given) that do not fit in the engine's free KV blocks.

        vLLM's kv_cache_usage counts blocks held by running requests; a request needing more than the rest
        forces preemption (someone's work is recomputed) or evicts what it just brought. Unknown block
        counts charge nothing rather than guess.
        """
        if not engine.num_blocks or engine.num_blocks <= 0:
            return 0.0
        capacity = _count(engine.num_blocks) * _block_size(engine)
        free = capacity * (1.0 - _clamp(engine.kv_usage, 0.0, 1.0))
        needed = uncached + (max_tokens or 0)
        overflow = min(float(capacity), max(0.0, needed - free))
        return p.prefill_s(overflow)

    def busy_wait_s(self, engine: EngineView, prompt: int, answer: float, depth: int, queue_s: float) -> float:
        """Waiting for blocks the streams already running there hold: this router's requests in flight on the
        engine (``EngineView.busy_blocks``) plus this one's prompt (less what they share with it) and expected
        answer, beyond the engine's blocks. A cached block counts as free in the engine's KV usage until a request
        references it again, and a turn's requests arrive together: six sessions whose histories fitted as cache
        overflowed the engine as running requests, and the newest waited a whole answer (2.0 s where 59 ms was
        expected; the engine preempts the newest request when blocks run out). The wait is about half a typical
        answer at the engine's batch depth, charged by the share of this request's blocks that do not fit, beyond
        the queueing the TTFT model already learned at that depth (``queue_s``): under steady load its waits for
        blocks are in that term (charged again, they cost a high-concurrency suite shape a point of hit rate)."""
        if not engine.num_blocks or engine.busy_blocks <= 0:
            return 0.0
        block = _block_size(engine)
        prompt_blocks = -(-prompt // block)
        own = prompt_blocks - min(_count(engine.busy_shared_blocks), prompt_blocks) + math.ceil(answer / block)
        over = _count(engine.busy_blocks) + own - _count(engine.num_blocks)
        if over <= 0 or own <= 0:
            return 0.0
        remaining = 0.5 * self.decode.tokens_after_first(None) * self.decode.time_per_token_s(engine.id, depth)
        return min(1.0, over / own) * max(0.0, remaining - queue_s)

    @staticmethod
    def eviction_s(engine: EngineView, answer: float, uncached: int, p: TTFTParams, knowledge: Knowledge) -> float:
        """Recompute that later requests can expect because this placement evicts cached blocks.

        The request allocates blocks for its uncached prompt and its ``answer`` (expected tokens); once the
        engine's empty blocks are used up, each one evicts a cached block, which is read again about as often as
        the engine's cache is read at all (its own recent hit ratio). Recomputing a prefix that another engine
        already holds therefore costs more than its own prefill when caches are full, and nothing while they have
        room; the ratio is measured, not tuned. Unknown block counts charge nothing.
        """
        held = engine.held_blocks if knowledge is Knowledge.EVENTS else engine.approx_held_blocks
        if not engine.num_blocks or held is None:
            return 0.0
        held, block = _count(held), _block_size(engine)
        needed = math.ceil((uncached + answer) / block)
        evicted = min(held, max(0, needed - max(0, _count(engine.num_blocks) - held)))
        return _clamp(engine.reuse_ratio, 0.0, 1.0) * p.prefill_s(evicted * block)

    @staticmethod
    def stall_s(depth: int, slots: int | None, uncached: int, p: TTFTParams) -> float:
        """What a request's prefill costs the streams already decoding on an engine: a prefill shares the
        engine's steps with the running batch (chunked prefill), so each stream there waits for it once (a
        1k-token miss is about a 40 ms step on an A40-class engine, a hit's short suffix next to nothing).
        Requests still waiting for a slot are not decoding. Charged by kv_aware when a prefix leaves its
        homes (gateway/routing/kv_aware.py), where it is measured; not part of ``estimate``.
        """
        in_batch, _ = split_depth(depth, slots)
        return in_batch * p.prefill_s(uncached)

    def adapter_s(self, engine: EngineView, depth: int) -> float:
        """A LoRA request where its adapter is not running: the adapter's load into a slot and, when other
        adapters hold every slot, a wait until one frees, about the time a running request takes to finish
        (vLLM schedules no request of a further adapter while ``max_loras`` are in the batch). Where the
        adapter runs already this is 0, so an adapter's requests gather on the engines running it until their
        queues cost more."""
        wait = self.decode.decode_s(engine.id, depth, None) if engine.adapter_slots_full else 0.0
        return _clamp(engine.adapter_load_s, 0.0, 60.0) + wait

    def _decode_s(self, engine: EngineView, after_first: float, depth: int) -> float:
        """The request's own decode there: its tokens after the first at the batch it decodes in, where this router's
        streams count by the share of that decode they still run (``decoding_depth``)."""
        per_token = self.decode.time_per_token_s(engine.id, depth)
        if not engine.stream_remaining_s or after_first <= 0:
            return after_first * per_token
        beside = decoding_depth(depth, engine.stream_remaining_s, after_first * per_token)
        return after_first * self.decode.time_per_token_s(engine.id, beside)

    def topology_penalty_s(self, engine: EngineView, request: RouteRequest) -> float:
        crosses = request.router_island is not None and engine.island not in (None, request.router_island)
        return self.settings.cross_island_s if crosses else 0.0

    def estimate(self, request: RouteRequest, engine: EngineView, knowledge: Knowledge) -> CandidateScore:
        return self.estimate_all(request, [engine], knowledge)[engine.id]

    def estimate_all(self, request: RouteRequest, engines: Sequence[EngineView], knowledge: Knowledge,
                     blind_eviction: bool = True) -> dict[str, CandidateScore]:
        """Every engine's estimate (by id), with what the request alone decides worked out once: a decision
        scores every engine, and redoing the request's clamps and expected answer per engine was a tenth of the
        scoring at 256 engines. ``blind_eviction`` False leaves ``eviction_s`` at 0 for a policy that prices
        evictions another way (kv_aware's homes) and would only replace it."""
        max_tokens = _max_tokens(request)
        terms = _RequestTerms(_count(request.prompt_tokens), max_tokens, self.decode.expected_output_tokens(max_tokens),
                              self.decode.tokens_after_first(max_tokens))
        return {engine.id: self._estimate(request, terms, engine, knowledge, blind_eviction) for engine in engines}

    def _estimate(self, request: RouteRequest, terms: _RequestTerms, engine: EngineView, knowledge: Knowledge,
                  blind_eviction: bool) -> CandidateScore:
        prompt = terms.prompt
        slots = engine_slots(engine)
        params = self.learner.params(engine.id, slots)
        exact, tiered, approx = overlaps(engine, prompt, knowledge)
        cached, trust = self.credited(engine, tiered, approx, knowledge)
        uncached = max(0, math.ceil(prompt - cached - 1e-9))
        depth = queue_depth(engine)
        load_s = tier_load_s(engine, prompt, knowledge)
        adapter_s = self.adapter_s(engine, depth)
        queue_s = params.queue_s(depth, slots) + adapter_s
        return CandidateScore(
            engine=engine.id,
            exact_tokens=exact,
            approx_tokens=approx,
            cached_tokens=cached,
            uncached_tokens=uncached,
            confidence=trust,
            queue_depth=depth,
            queue_s=queue_s,
            prefill_s=params.overhead_s + params.prefill_s(uncached) + load_s,
            pressure_penalty_s=(self.pressure_penalty_s(engine, terms.max_tokens, uncached, params)
                                + self.busy_wait_s(engine, prompt, terms.answer, depth, queue_s)),
            topology_penalty_s=self.topology_penalty_s(engine, request),
            live=engine.live,
            decode_s=self._decode_s(engine, terms.after_first, depth),
            eviction_s=(self.eviction_s(engine, terms.answer, uncached, params, knowledge) if blind_eviction
                        else 0.0),
            tier_runs=engine.tier_runs if load_s else (),
            tier_tokens=tiered - exact,
            load_s=load_s,
            adapter_s=adapter_s,
        )
