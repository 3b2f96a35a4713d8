"""Which engines serve one request in a disaggregated fleet, and whether the prefill leg is worth it (sans-IO).

The routing decision's first decode engine decides whether the prefill leg is worth it: it is skipped, and
the request served whole there, when it cannot help: ``n > 1`` (a handoff has one consumer), a short prompt,
a decode engine that holds all but a few blocks, or no prefill engine to pair with any decode engine. When
the leg runs, the cost policies (``kv_aware``, ``approximate``) order the decode engines by their decode
load (they receive the prompt's blocks, they do not prefill them; what they hold only breaks ties) and the
prefill engines, among those that speak the protocol of the first decode engine that has any (a fleet may
mix connectors), by the estimated time of the leg there (the prompt work queued ahead of it plus the part
of the prompt the engine does not hold); ``round_robin`` takes each role's engines in turn; other policies
keep their own order.
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
    """The estimated time of a prefill leg there: the prompt work queued ahead, its own uncached part and
    the other requests ahead (gateway/disaggregation/prefill_load.py)."""
    load_s: float = 0.0
    """The cost model's queue and decode time of the request there: what a decode leg waits for."""


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


ORDER_OF_POLICY = {"kv_aware": "cost", "approximate": "cost", "round_robin": "rotate"}
"""How each policy orders the engines of both legs (see the module's docstring); unnamed ones: ``ranked``.
A round robin over all engines, restricted to one role, is none: with two engines of each role it sent
three decode legs in four to the same engine."""


def choose(members: Sequence[Member], prompt_tokens: int, n: int, config: PdConfig, order: str = "cost",
           turn: int = 0) -> PdChoice:
    """The decode engines (ranked), the prefill engines paired with the first (ranked), or why there are none.

    ``prompt_tokens`` is 0 when the router did not count the prompt (a policy that does not tokenize):
    only ``n`` and the pairing can skip the leg then. ``turn`` counts the P/D requests so far (``rotate``)."""
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
    if order == "rotate":
        decoders = _rotated(decoders, turn)
    elif order == "cost":
        decoders = sorted(decoders, key=lambda m: (m.load_s, -m.overlap_tokens))  # held: less to pull
    # In a fleet of mixed connectors, the best decode engine that some prefill engine can hand over to.
    found = next(((d, p) for d in decoders if (p := _pairs(members, d))), None)
    if found is None:
        return PdChoice(ids, [], None, "no_prefill_engine")
    first, paired = found
    decoders = [first, *(d for d in decoders if d is not first)]
    if order == "rotate":
        paired = _rotated(paired, turn)
    elif order == "cost":
        # A prefill leg only prefills: ranked by the whole-request cost (decode, cache displacement), the
        # prefill legs of `kvmesh bench pd` waited longer than round robin's: TTFT p50 3.26 s vs 1.54 s at 16.
        paired = sorted(paired, key=lambda m: m.ttft_s)
    return PdChoice([m.id for m in decoders], [m.id for m in paired], first.protocol, None)


def _pairs(members: Sequence[Member], decoder: Member) -> list[Member]:
    """The prefill engines that can hand ``decoder`` the prompt: those of its protocol (but itself)."""
    return [m for m in members if prefills(m.role) and m.protocol == decoder.protocol and m.id != decoder.id]


def _rotated(engines: list[Member], turn: int) -> list[Member]:
    ordered = sorted(engines, key=lambda m: m.id)
    start = turn % len(ordered)
    return ordered[start:] + ordered[:start]
