"""Offloaded KV tiers: where an engine's CPU and storage tiers keep their blocks in the index.

vLLM's offloading connector (with ``self_describing_kv_events``) announces the blocks it stores in a
lower tier with ``medium`` "CPU" or "STORAGE", the same engine block hashes, token ids and parent as the
GPU event, so the own keys are the same too. Each tier of an event source is a holder of its own in the
store (``<holder>@CPU``): a GPU-only fleet has no such holder and pays nothing for tiers, and a block
in both GPU and CPU memory is two bits of one mask, not a second entry.

A prompt's blocks past the engine's GPU prefix that a lower tier holds can be loaded instead of
recomputed: ``tier_runs`` finds them, and the router prices each as its transfer time (bytes per block
over the tier's bandwidth), not as zero or a full prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from index.store import BlockStore

TIER_MEDIA = ("CPU", "STORAGE")
"""Lower tiers in the order an engine's connector looks them up (nearest first)."""
_TIER_MARK = "@"


def tier_holder(holder: str, medium: str) -> str:
    """The store key of one event source's blocks in a lower tier."""
    return f"{holder}{_TIER_MARK}{medium}"


def clear_source(store: BlockStore, holder: str) -> int:
    """Drop an event source's blocks, its lower tiers' included; returns how many were dropped."""
    return store.clear(holder) + sum(store.clear(tier_holder(holder, medium)) for medium in TIER_MEDIA)


def source_of(holder: str) -> str:
    """The event source a tier holder belongs to (the key itself for a GPU holder)."""
    source, mark, medium = holder.rpartition(_TIER_MARK)
    return source if mark and source and medium in TIER_MEDIA else holder


@dataclass(frozen=True, slots=True)
class TierRun:
    """``blocks`` consecutive prompt blocks held in ``medium``, right after the previous run."""

    medium: str
    blocks: int


def tier_holders(store: BlockStore, holders: Sequence[str]) -> list[tuple[str, str]]:
    """(medium, tier holder) of every lower tier of these sources that holds a block, nearest tier first."""
    return [(medium, key) for medium in TIER_MEDIA for holder in holders
            if store.block_count(key := tier_holder(holder, medium))]


def tier_runs(store: BlockStore, chain: Sequence[int], start: int,
              tiers: Sequence[tuple[str, str]]) -> tuple[TierRun, ...]:
    """The runs of ``chain[start:]`` that lower tiers hold without a gap, each block from the nearest tier
    holding it: the blocks a connector would load after the GPU prefix hit of ``start`` blocks."""
    runs: list[TierRun] = []
    for key in chain[start:]:
        medium = next((m for m, holder in tiers if store.holds(holder, key)), None)
        if medium is None:
            break
        if runs and runs[-1].medium == medium:
            runs[-1] = TierRun(medium, runs[-1].blocks + 1)
        else:
            runs.append(TierRun(medium, 1))
    return tuple(runs)
