"""The realistic mix's messages recorded once, as an engine's publisher frames them, for the ingest benchmarks."""

from __future__ import annotations

import gc
from dataclasses import dataclass

from bench.event_mix import MixEngine

MODEL = "kvmesh-tiny"
Message = tuple[int, list[bytes]]
"""An engine's number and the frames its publisher sends (topic, seq, payload)."""


def recorded(engines: list[MixEngine], steps: int, seqs: list[int]) -> tuple[list[Message], int]:
    """``steps`` messages of every engine in turn, their seqs continuing ``seqs``; and their block ops."""
    out: list[Message] = []
    ops = 0
    for _ in range(steps):
        for i, engine in enumerate(engines):
            batch = engine.next_batch(0.0)
            out.append((i, [b"kv", seqs[i].to_bytes(8, "big"), batch.payload]))
            seqs[i] += 1
            ops += batch.ops
    return out, ops


@dataclass(frozen=True)
class RecordedMix:
    fill: list[Message]
    """Every engine's messages until its cache is full (the first eviction onwards is the mix's steady state)."""
    fill_ops: int
    steady: list[Message]
    """``steps`` more messages of every engine, full: stores and evictions."""
    steady_ops: int


def recorded_mix(engines: int, cap: int, steps: int, seed: int = 0) -> RecordedMix:
    """E engines of ``cap`` blocks each, recorded from empty until full and then for ``steps`` steps."""
    fleet = [MixEngine(i, cap, MODEL, seed=seed) for i in range(engines)]
    seqs = [0] * engines
    fill: list[Message] = []
    fill_ops = 0
    while not all(e.full for e in fleet):
        more, more_ops = recorded(fleet, 10, seqs)
        fill += more
        fill_ops += more_ops
    steady, steady_ops = recorded(fleet, steps, seqs)
    return RecordedMix(fill, fill_ops, steady, steady_ops)


def freeze() -> None:
    """Take what the bench keeps (recorded frames, decoded batches: no replica's objects) out of the cyclic
    collector's walks, as a replica does with its start-up objects (gateway/server.py). Walked, they made
    the full collections cost up to 1 us per op, in whichever pass one happened to land. They stay frozen
    (freed by their reference counts when dropped): unfreezing would also release what a caller froze."""
    gc.collect()
    gc.freeze()
