"""The KV blocks this router's requests in flight will hold on each engine until they finish (sans-IO).

An engine's KV usage counts the blocks its running requests reference; a cached block nobody references is free
to evict. So a conversation whose history is cached there takes those blocks back when its next turn runs, and
the streams answering there grow by a block every ``block_size`` tokens. When their prompts and answers together
outgrow the engine's blocks, the engine makes the newest request wait or preempts it until another finishes: a
whole answer's time. The poll's usage cannot see it coming (a turn's requests arrive together, right after the
previous turn's streams freed their blocks); the router's own dispatches can.

Each dispatch adds its prompt's block keys (a chain from the model's root, so any block shared with another
request in flight shares everything before it) and its private blocks (the prompt's blocks past its chain: the
partial last one, a rest routed unencoded; and its expected answer's); its end takes them away.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InFlightClaim:
    """What one dispatch added on one engine, to take away exactly once when the request ends."""

    engine: str
    keys: tuple[int, ...]
    private_blocks: int


class InFlightBlocks:
    """Per engine: how many requests in flight reference each prompt block, and their private blocks."""

    def __init__(self) -> None:
        self._refs: dict[str, dict[int, int]] = {}
        self._private: dict[str, int] = {}

    def add(self, engine: str, chain: Sequence[int], private_blocks: int) -> InFlightClaim:
        refs = self._refs.setdefault(engine, {})
        for key in chain:
            refs[key] = refs.get(key, 0) + 1
        private_blocks = max(0, private_blocks)
        self._private[engine] = self._private.get(engine, 0) + private_blocks
        return InFlightClaim(engine, tuple(chain), private_blocks)

    def release(self, claim: InFlightClaim) -> None:
        refs = self._refs.get(claim.engine)
        if refs is None:
            return
        for key in claim.keys:
            left = refs.get(key, 0) - 1
            if left > 0:
                refs[key] = left
            else:
                refs.pop(key, None)
        left_private = self._private.get(claim.engine, 0) - claim.private_blocks
        if refs or left_private > 0:
            self._private[claim.engine] = max(0, left_private)
        else:
            self._refs.pop(claim.engine, None)
            self._private.pop(claim.engine, None)

    def held(self, engine: str) -> int:
        """Blocks the engine's requests in flight will hold: their distinct chain blocks and their private ones."""
        return len(self._refs.get(engine, ())) + self._private.get(engine, 0)

    def shared(self, engine: str, chain: Sequence[int]) -> int:
        """Leading blocks of ``chain`` that a request in flight on ``engine`` already holds. Chains are prefix-closed,
        so the held ones are a prefix: a binary search reads about log2(len(chain)) of them."""
        refs = self._refs.get(engine)
        if not refs:
            return 0
        low, high = 0, len(chain)
        while low < high:
            middle = (low + high + 1) // 2
            if chain[middle - 1] in refs:
                low = middle
            else:
                high = middle - 1
        return low
