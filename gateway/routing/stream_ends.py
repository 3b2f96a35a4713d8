"""When this router's streams in flight on each engine are expected to end (sans-IO), and the batch a new
answer decodes in.

A closed-loop client sends its next request as soon as its answer ends, so at a turn's edge the engines that
served the last turn still count its streams, which end a few tokens later. Priced as a batch lasting the new
answer's whole decode, they pushed a hot prefix off its holders onto engines holding nothing: in seed 1's suite
shape #12 (19 streams of 223-token answers, two system prompts) 10 of a wave's 19 requests spilled cold while the
holders' streams ended within 60 ms. So one of this router's streams counts in the new answer's batch by the
share of that answer's decode it is still expected to run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """One dispatch's expected end on its engine, to take away exactly once when the request ends."""

    engine: str
    number: int


class StreamEnds:
    """Per engine, the expected end (on the planner's clock) of each of this router's streams in flight."""

    def __init__(self) -> None:
        self._ends: dict[str, dict[int, float]] = {}
        self._numbered = 0

    def add(self, engine: str, ends_at: float) -> StreamEnd:
        self._numbered += 1
        self._ends.setdefault(engine, {})[self._numbered] = ends_at
        return StreamEnd(engine, self._numbered)

    def release(self, end: StreamEnd) -> None:
        ends = self._ends.get(end.engine)
        if ends is None:
            return
        ends.pop(end.number, None)
        if not ends:
            del self._ends[end.engine]

    def remaining(self, engine: str, now: float) -> tuple[float, ...]:
        """Seconds each of the engine's streams is still expected to run (0 for one past its expected end)."""
        ends = self._ends.get(engine)
        if not ends:
            return ()
        return tuple(end - now if end > now else 0.0 for end in ends.values())


def decoding_depth(depth: int, remaining: Sequence[float], horizon_s: float) -> float:
    """Streams beside a new answer over its decode of ``horizon_s``, on average: this router's (``remaining``: the
    seconds each still runs) by the share of the horizon they overlap, the rest of ``depth`` (other replicas',
    the engine's polled ones) whole. Never more than ``depth``."""
    depth = max(0, depth)
    if not remaining or horizon_s <= 0:
        return float(depth)
    others = max(0, depth - len(remaining))
    overlap = sum(r / horizon_s if r < horizon_s else 1.0 for r in remaining)
    return min(float(depth), others + overlap)
