"""Render a Decision for people: the ``x-kvmesh-route`` response header and the ``POST /debug/route`` table.

The table's ``home`` says which engines the prompt's prefix is homed on (gateway/routing/homes.py) and,
when the chosen engine is not one of them, which term of the estimate made the request leave.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from gateway.routing.types import CandidateScore, Decision

HEADER_NAME = "x-kvmesh-route"
_UNSAFE = re.compile(r"[^!#-:<-~]+")


def _token(text: str) -> str:
    """Visible ASCII without ';' or spaces, so the header stays one parseable line of key=value pairs."""
    return _UNSAFE.sub("-", text.replace("; ", ",")).strip("-") or "-"


def public_engine_name(engine_id: str) -> str:
    """What a tenant is told of an engine: a stable opaque name (the same on every replica and across
    restarts: a digest of the id), never the id itself, which defaults to the engine's host:port."""
    return "engine-" + hashlib.blake2b(engine_id.encode("utf-8", "surrogatepass"), digest_size=6,
                                       person=b"kvmesh-engine").hexdigest()


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 1)


def route_header(decision: Decision, detailed: bool = True) -> str:
    """e.g. ``engine=e1; overlap=1984/2048; est_ttft_ms=42.1; reason=cache-hit-97%; policy=kv_aware``.

    Without ``detailed`` only the engine's public name and the policy: overlap, estimates and reasons say
    what the engines hold, and a tenant must not learn block by block whether another tenant's prompt is
    cached, nor where the engines listen."""
    if not detailed:
        return f"engine={public_engine_name(decision.table[0].engine) if decision.table else 'none'}; " \
               f"policy={_token(decision.policy)}"
    if not decision.table:
        return f"engine=none; reason={_token(decision.reason)}; policy={_token(decision.policy)}"
    best = decision.table[0]
    return (
        f"engine={_token(best.engine)}; overlap={best.overlap_tokens}/{decision.prompt_tokens}; "
        f"est_ttft_ms={_ms(best.ttft_s)}; reason={_token(decision.reason)}; policy={_token(decision.policy)}"
    )


def _runs(score: CandidateScore) -> list[dict[str, Any]]:
    """The prompt's leading blocks the engine holds, by tier: its GPU prefix, then offloaded runs it loads."""
    gpu = [{"medium": "GPU", "tokens": score.exact_tokens}] if score.exact_tokens else []
    return gpu + [{"medium": medium, "blocks": blocks, "load_ms": _ms(blocks * per_block_s)}
                  for medium, blocks, per_block_s in score.tier_runs]


def _row(rank: int, score: CandidateScore) -> dict[str, Any]:
    return {
        "rank": rank,
        "engine": score.engine,
        "live": score.live,
        "overlap_exact_tokens": score.exact_tokens,
        "overlap_approx_tokens": score.approx_tokens,
        "matched_runs": _runs(score),
        "load_ms": _ms(score.load_s),
        "adapter_ms": _ms(score.adapter_s),
        "credited_cached_tokens": round(score.cached_tokens, 1),
        "uncached_tokens": score.uncached_tokens,
        "confidence": round(score.confidence, 3),
        "queue_depth": score.queue_depth,
        "queue_ms": _ms(score.queue_s),
        "prefill_ms": _ms(score.prefill_s),
        "pressure_penalty_ms": _ms(score.pressure_penalty_s),
        "topology_penalty_ms": _ms(score.topology_penalty_s),
        "est_ttft_ms": _ms(score.ttft_s),
        "decode_ms": _ms(score.decode_s),
        "est_done_ms": _ms(score.done_s),
        "eviction_ms": _ms(score.eviction_s),
        "home": score.home,
        "displacement_ms": _ms(score.displacement_s),
        "crowding_ms": _ms(score.crowding_s),
        "stall_ms": _ms(score.stall_s),
        "overflow_ms": _ms(score.overflow_s),
        "cost_ms": _ms(score.cost_s),
    }


def _home(decision: Decision) -> dict[str, Any] | None:
    note = decision.home
    if note is None:
        return None
    return {
        "prefix": note.key,
        "blocks": note.blocks,
        "homes": list(note.homes),
        "heat": round(note.heat, 2),
        "chosen_is_home": decision.chosen in note.homes,
        "left_home_because": note.left_because,
    }


def route_table(decision: Decision) -> dict[str, Any]:
    """A JSON-able explanation: the verdict and one row per ranked candidate, best first."""
    return {
        "policy": decision.policy,
        "reason": decision.reason,
        "chosen": decision.chosen,
        "prompt_tokens": decision.prompt_tokens,
        "ranked": list(decision.ranked),
        "candidates": [_row(i + 1, s) for i, s in enumerate(decision.table)],
        "home": _home(decision),
    }
