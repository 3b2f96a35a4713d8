"""Which engines serve one request in a disaggregated fleet, and whether the prefill leg is worth it (sans-IO).

The decode engine is chosen first, from the routing decision's ranking (load, and what the engine already
holds, which it need not be sent); then the prefill engine, from the same ranking restricted to engines
that speak the decode engine's protocol (the index's overlap and load: one that holds the prompt's head
prefills only the rest). The prefill leg is skipped, and the request served whole on the decode engine,
when it cannot help: ``n > 1`` (a handoff has one consumer), a short prompt, a decode engine that holds all
but a few blocks, or no prefill engine to pair with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.disaggregation.config import PdConfig
from gateway.disaggregation.roles import decodes, prefills


@dataclass(frozen=True, slots=True)
class Member:
    """One candidate engine as the decider sees it, in the routing decision's order (best first)."""

    id: str
    role: str
    protocol: str
    overlap_tokens: int = 0
    block_size: int = 16
    ttft_s: float = 0.0
    """The cost model's time to first token there: its queue plus the prefill of what it does not hold."""


@dataclass(frozen=True, slots=True)
class PdChoice:
    """``prefill`` is empty when the leg is skipped; ``skipped`` then says why (a bounded metric label)."""

    decode: list[str]
    prefill: list[str]
    protocol: str | None
    skipped: str | None

    def explain(self) -> dict[str, object]:
        return {"decode": self.decode, "prefill": self.prefill, "protocol": self.protocol,
                "prefill_leg": self.skipped is None, "skipped_because": self.skipped}


def disaggregated(roles: Sequence[str]) -> bool:
    """Whether the model's fleet (every engine that serves it, up or not) splits the work: some engine only
    prefills and another can decode."""
    return "prefill" in roles and any(decodes(role) for role in roles)


def choose(members: Sequence[Member], prompt_tokens: int, n: int, config: PdConfig) -> PdChoice:
    """The decode engines (ranked), the prefill engines paired with the first (ranked), or why there are none.

    ``prompt_tokens`` is 0 when the router did not count the prompt (a policy that does not tokenize):
    only ``n`` and the pairing can skip the leg then."""
    decoders = [m for m in members if decodes(m.role)]
    if not decoders:  # a prefill engine serves whole requests too: better slower than refused
        return PdChoice([m.id for m in members], [], None, "no_decode_engine")
    ids = [m.id for m in decoders]
    first = decoders[0]
    if n > 1:
        return PdChoice(ids, [], None, "n_above_1")
    if prompt_tokens and prompt_tokens < config.min_prefill_tokens:
        return PdChoice(ids, [], None, "short_prompt")
    uncached = prompt_tokens - first.overlap_tokens
    if prompt_tokens and uncached <= config.max_uncached_blocks * first.block_size:
        return PdChoice(ids, [], None, "decode_holds_prompt")
    # A prefill leg only prefills: its engines are ranked by queue and uncached prefill alone, not by the
    # decode and cache-displacement terms that rank whole requests. Taken in that whole-request order, the
    # prefill legs of `kvmesh bench pd` waited longer than round robin's: TTFT p50 3.26 s vs 1.54 s at 16.
    paired = [m for m in members if prefills(m.role) and m.protocol == first.protocol and m.id != first.id]
    pair = [m.id for m in sorted(paired, key=lambda m: m.ttft_s)]
    if not pair:
        return PdChoice(ids, [], None, "no_prefill_engine")
    return PdChoice(ids, pair, first.protocol, None)
