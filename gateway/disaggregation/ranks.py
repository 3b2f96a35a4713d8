"""Data-parallel rank pinning of a P/D pair's two legs (``X-data-parallel-rank``), without I/O.

A data-parallel vLLM engine is one URL in front of several engine cores (ranks), each with its own KV cache
and event stream; a request's ``X-data-parallel-rank`` header sends it to one rank (vLLM refuses a rank
outside ``[0, size)`` with a 400). In a disaggregated pair the router is the authority on the rank: it picks
one prefill rank and pins both legs to it (vLLM 0.32's MoRIIO connector documents this contract, after
llm-d's routing sidecar, and notifies only that rank). kvmesh picks the prefill rank by what each rank holds
(its index keeps every rank's blocks apart): the rank holding most of the prompt prefills least; a prompt no
rank holds goes to the ranks in turn, as a hash of the request would spread it.
"""

from __future__ import annotations

from collections.abc import Sequence

RANK_HEADER = "x-data-parallel-rank"


def pick_rank(ranks: Sequence[int], held: Sequence[int], turn: int) -> int | None:
    """The rank to pin a prefill leg to; None for an engine without data parallelism (one rank, or ranks
    unknown). ``held`` is the prompt's blocks each rank holds, in the order of ``ranks``."""
    if len(ranks) < 2:
        return None
    best = max(held) if len(held) == len(ranks) else 0
    tied = [r for r, h in zip(ranks, held, strict=True) if h == best] if best > 0 else list(ranks)
    return tied[turn % len(tied)]


def pinned(headers: list[tuple[str, str]], rank: int | None) -> list[tuple[str, str]]:
    """``headers`` with the leg's rank in place of any the client sent; unchanged when not pinned."""
    if rank is None:
        return headers
    return [(k, v) for k, v in headers if k != RANK_HEADER] + [(RANK_HEADER, str(rank))]
