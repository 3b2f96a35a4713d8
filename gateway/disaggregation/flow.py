"""One request through a prefill engine and then a decode engine (the I/O edge of the P/D flow).

The prefill leg goes through the same proxy as any request (ranked prefill engines, breakers, failover
before the first byte), with its answer kept from the client. Whatever goes wrong on it, the client never
sees it: a prefill leg that fails, on ``prefill_attempts`` engines or under ``prefill_failover = "decode"``
on the first, or that answers anything but 200, leaves the decode engine to serve the request whole. The
decode leg is the client's request, proxied as usual (failover before the first token, mid-stream
continuation after it); with the ``handoff`` protocol its first attempt carries the prefill's
``kv_transfer_params``, unless they are missing or the lease would be over when it starts, and any later
attempt carries none (a handoff has one consumer): those decode engines recompute the prompt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from gateway.breaker import CircuitBreaker
from gateway.disaggregation.config import PdConfig
from gateway.disaggregation.decider import ORDER_OF_POLICY, Member, PdChoice, choose, disaggregated
from gateway.disaggregation.prefill_load import PrefillLeg, PrefillLoad
from gateway.disaggregation.ranks import pick_rank, pinned
from gateway.disaggregation.wire import decode_body, expires_in, handoff_params, prefill_body
from gateway.engines import EngineState
from gateway.metrics import RouterMetrics
from gateway.proxy import Exchange, Forward, ProxyResult, UpstreamFailure
from gateway.routing import public_engine_name
from gateway.routing.types import CandidateScore, Decision

log = logging.getLogger("kvmesh.pd")
PD_HEADER = b"x-kvmesh-pd"
MAX_PREFILL_ANSWER_BYTES = 1024 * 1024
"""A prefill answer is one token and its handoff (at most 64 KiB, see wire.py): an engine sending more is not
buffered past this; its request goes on to the decode engine without params, which recomputes."""


@dataclass
class PdRoute:
    """A request's engines in a disaggregated fleet: ``decode`` serve it, ``prefill`` (maybe none) go first."""

    choice: PdChoice
    decode: list[EngineState]
    prefill: list[EngineState]
    legs: dict[str, PrefillLeg]
    """Each prefill engine's leg as priced for this request (what its measured time teaches the model)."""
    ranks: dict[str, int] = field(default_factory=dict)
    """The data-parallel rank each data-parallel prefill engine's leg is pinned to (and, with a handoff, the
    decode leg after it: gateway/disaggregation/ranks.py)."""


Estimate = Callable[[str, int, int], float]
"""The TTFT model's time for a prefill leg: (engine, work tokens, other requests ahead) -> seconds."""
Observe = Callable[[str, int, int, float], None]
"""Feeds one measured prefill leg to the TTFT model: (engine, work tokens, other requests ahead, seconds)."""
HeldByRank = Callable[[str], tuple[int, ...]]
"""The prompt's leading blocks each data-parallel rank of an engine holds, in the order of its ranks."""


class Disaggregation:
    """Chooses each request's P/D route and drives its two legs, keeping count of the prefill work in flight."""

    def __init__(self, config: PdConfig, metrics: RouterMetrics, estimate: Estimate, observe: Observe) -> None:
        self.config = config
        self.metrics = metrics
        self.estimate = estimate
        self.observe = observe
        self.load = PrefillLoad()
        self._turn = 0
        self._rank_turn = 0

    def prefill_breaker(self, engine: EngineState) -> CircuitBreaker:
        """The breaker of an engine's prefill legs: its own for a prefill-only engine (that is all it does),
        one of their own for an engine that also decodes, so that failed prefill legs keep only prefill legs
        from it (as smg counts a prefill failure against the prefill side only)."""
        return engine.health.breaker if engine.role == "prefill" else engine.health.prefill_breaker

    def route(self, fleet: list[EngineState], ranked: list[EngineState], decision: Decision,
              prompt_tokens: int, body: dict[str, Any], dry_run: bool = False,
              held: HeldByRank = lambda engine: ()) -> PdRoute | None:
        """The P/D route of a request whose candidates are ``ranked`` (the routing decision's order) among the
        model's ``fleet``; None when that fleet is not disaggregated (no prefill-only engine). A ``dry_run``
        (``/debug/route``) does not take a round robin's turn."""
        if not disaggregated([e.role for e in fleet]):
            return None
        scores = {score.engine: score for score in decision.table}
        legs = {e.id: self.load.price(e.id, scores[e.id].uncached_tokens, scores[e.id].queue_depth)
                for e in ranked if e.id in scores}
        members = [self._member(e, scores.get(e.id), legs.get(e.id)) for e in ranked]
        n = body.get("n")
        order = ORDER_OF_POLICY.get(decision.policy, "ranked")
        choice = choose(members, prompt_tokens, n if type(n) is int else 1, self.config, order, self._turn)
        if choice.prefill and order == "rotate" and not dry_run:
            self._turn += 1
        by_id = {e.id: e for e in ranked}
        prefill = [by_id[i] for i in choice.prefill]
        ranks = {e.id: rank for e in prefill if len(e.dp_ranks) > 1  # no index query without data parallelism
                 and (rank := pick_rank(e.dp_ranks, held(e.id), self._rank_turn)) is not None}
        if ranks and not dry_run:
            self._rank_turn += 1
        return PdRoute(choice, [by_id[i] for i in choice.decode], prefill, legs, ranks)

    def _member(self, engine: EngineState, score: CandidateScore | None, leg: PrefillLeg | None) -> Member:
        if score is None or leg is None:
            return Member(engine.id, engine.role, engine.kv_protocol, 0, engine.block_size)
        leg_s = self.estimate(engine.id, leg.work, leg.other_depth)
        return Member(engine.id, engine.role, engine.kv_protocol, score.overlap_tokens,
                      engine.block_size, leg_s, score.queue_s + score.decode_s)

    async def serve(self, route: PdRoute, body: dict[str, Any], raw: bytes, exchange: Exchange, forward: Forward,
                    max_attempts: int, detailed: bool) -> ProxyResult:
        """Run the prefill leg when there is one, then the decode leg to the client."""
        choice = route.choice
        params: dict[str, Any] | None = None
        deadline = trio.current_time()
        served_by: str | None = None
        outcome = f"skipped_{choice.skipped}"
        if route.prefill:
            answer = await self._prefill(route, body, exchange, forward)
            if answer is None:
                outcome = "prefill_failed"
            else:
                served_by, text = answer
                outcome = "disaggregated"
                received = trio.current_time()
                if choice.protocol == "handoff":
                    params = handoff_params(text)
                    if params is None:
                        self.metrics.pd_handoffs.labels("missing_params").inc()
                    deadline = received + self.config.lease_s - self.config.lease_margin_s
                    left = expires_in(params or {}, time.time())
                    if left is not None:
                        deadline = min(deadline, received + left - self.config.lease_margin_s)
        self.metrics.pd_requests.labels(outcome).inc()
        plain = decode_body(body, None) if "kv_transfer_params" in body else raw
        handed = params is not None and choice.protocol == "handoff"
        state: dict[str, Any] = {"first": True, "handed_to": None}

        def body_for(engine: EngineState) -> bytes:
            first, state["first"] = state["first"], False
            if not first:
                self.metrics.pd_handoffs.labels("retried_without_params").inc()
                return plain
            if engine.kv_protocol != choice.protocol:
                self.metrics.pd_handoffs.labels("unpaired_decode").inc()
                return plain
            if trio.current_time() > deadline:
                self.metrics.pd_handoffs.labels("lease_expired").inc()
                return plain
            self.metrics.pd_handoffs.labels("sent").inc()
            state["handed_to"] = engine.id
            return decode_body(body, params)

        rank = route.ranks.get(served_by) if served_by is not None else None

        def headers_for(engine: EngineState, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
            """The handoff's decode engine reads from the prefill's rank on its rank of the same number."""
            same = state["handed_to"] == engine.id and rank in engine.dp_ranks
            return pinned(headers, rank if same else None)

        note = self._note(served_by, choice, outcome, detailed)
        route_header = exchange.route_header

        def with_note(engine: EngineState, attempts: list) -> list[tuple[bytes, bytes]]:
            return [*route_header(engine, attempts), (PD_HEADER, note)]

        leg = replace(exchange, body=plain, body_for=body_for if handed else None, route_header=with_note,
                      headers_for=headers_for if handed and rank is not None else None)
        return await forward(route.decode, leg, max_attempts)

    async def _prefill(self, route: PdRoute, body: dict[str, Any], exchange: Exchange, forward: Forward
                       ) -> tuple[str, bytes] | None:
        """The prefill leg: (engine, its JSON answer), or None when no prefill engine answered 200."""
        captured: dict[str, Any] = {"status": 0, "body": [], "size": 0}

        async def keep(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                captured["status"] = message["status"]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                captured["size"] += len(chunk)
                if captured["size"] <= MAX_PREFILL_ANSWER_BYTES:  # past it the answer is dropped: no params
                    captured["body"].append(chunk)
                else:
                    captured["body"] = []

        attempts = 1 if self.config.prefill_failover == "decode" else self.config.prefill_attempts
        leg = replace(exchange, body=prefill_body(body, route.choice.protocol or "opaque"), send=keep,
                      is_stream=False, continuation=None, body_for=None, breaker=self.prefill_breaker,
                      headers_for=lambda engine, headers: pinned(headers, route.ranks.get(engine.id)))
        found = route.legs.get(route.prefill[0].id)
        priced = found or PrefillLeg(route.prefill[0].id, 0, 0, 0)  # not priced (no score): nothing to learn
        self.load.begin(priced)
        started = trio.current_time()
        try:
            result = await forward(route.prefill, leg, attempts)
        except UpstreamFailure as failure:
            self._count_failures(failure.attempts)
            log.warning("prefill leg failed; the decode engine serves the request whole",
                        extra={"attempts": [(a.engine, a.outcome) for a in failure.attempts]})
            return None
        finally:
            self.load.end(priced)
        self._count_failures(result.attempts)
        if result.engine is None or captured["status"] != 200:
            self.metrics.pd_leg_failures.labels("prefill", f"status_{captured['status']}"[:16]).inc()
            return None
        if found is not None and len(result.attempts) == 1 and result.engine.id == found.engine:
            # The leg's whole answer is its one token: queue and prefill there, what the TTFT model learns.
            self.observe(priced.engine, priced.work, priced.other_depth, trio.current_time() - started)
        if captured["size"] > MAX_PREFILL_ANSWER_BYTES:
            self.metrics.pd_leg_failures.labels("prefill", "answer_too_large").inc()
            return result.engine.id, b""
        return result.engine.id, b"".join(captured["body"])

    def _count_failures(self, attempts: list) -> None:
        for cause in self.metrics.count_failed_attempts(attempts):
            self.metrics.pd_leg_failures.labels("prefill", cause).inc()

    @staticmethod
    def _note(prefill: str | None, choice: PdChoice, outcome: str, detailed: bool) -> bytes:
        if prefill is None:
            return f"prefill=none; outcome={outcome}".encode()
        name = prefill if detailed else public_engine_name(prefill)
        return f"prefill={name}; protocol={choice.protocol}; outcome={outcome}".encode()


def explain(route: PdRoute | None) -> dict[str, Any] | None:
    return None if route is None else route.choice.explain()



