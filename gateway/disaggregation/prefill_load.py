"""The prefill work this router has in flight on each engine, and what a new prefill leg waits for there (sans-IO).

A prefill engine schedules prompts first come, first served, in chunks of its token budget (vLLM's chunked
prefill), and a prefill leg ends with its one token: its answer comes after every uncached prompt token
queued before it, and its own. The TTFT model's queue term counts requests ahead, which says little on
such an engine when one of them is a 16k-token prompt and the next a cache hit; the tokens say it. So a
prefill leg is priced, and its measured time fed back to the TTFT model, with the work ahead of it counted
in the model's prefill term: ``work = tokens still queued by this router's prefill legs there + its own
uncached tokens``, and the queue term left to requests there that are not this router's prefill legs (other
replicas' traffic, whole requests on an engine that does both). Without the work ahead, `kvmesh bench pd`
sent a shared document's prefill legs to the engine that held it until its queue was many prompts deep:
TTFT p50 3.07 s against round robin's 1.86 s at 16 streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PrefillLeg:
    """One prefill leg as priced when it was sent: what to hand back to the TTFT model with its measured time."""

    engine: str
    tokens: int
    """Its own uncached prompt tokens there."""
    work: int
    """Tokens the engine prefills before answering it: the legs' work queued ahead, plus its own."""
    other_depth: int
    """Requests there that are not this router's prefill legs."""


@dataclass
class PrefillLoad:
    """Uncached prompt tokens and legs this router has sent to each engine and not yet seen answered."""

    _tokens: dict[str, int] = field(default_factory=dict)
    _legs: dict[str, int] = field(default_factory=dict)

    def ahead(self, engine_id: str) -> int:
        return self._tokens.get(engine_id, 0)

    def legs(self, engine_id: str) -> int:
        return self._legs.get(engine_id, 0)

    def price(self, engine_id: str, uncached_tokens: int, queue_depth: int) -> PrefillLeg:
        """A new leg of ``uncached_tokens`` there, where ``queue_depth`` requests (this router's legs among
        them) are ahead by the routing decision's count."""
        tokens = max(0, uncached_tokens)
        return PrefillLeg(engine_id, tokens, self.ahead(engine_id) + tokens,
                          max(0, queue_depth - self.legs(engine_id)))

    def begin(self, leg: PrefillLeg) -> None:
        self._tokens[leg.engine] = self.ahead(leg.engine) + leg.tokens
        self._legs[leg.engine] = self.legs(leg.engine) + 1

    def end(self, leg: PrefillLeg) -> None:
        """The leg is over, answered or not (call it exactly once per ``begin``)."""
        tokens, legs = self.ahead(leg.engine) - leg.tokens, self.legs(leg.engine) - 1
        if legs <= 0:
            self._tokens.pop(leg.engine, None)
            self._legs.pop(leg.engine, None)
        else:
            self._tokens[leg.engine], self._legs[leg.engine] = max(0, tokens), legs
