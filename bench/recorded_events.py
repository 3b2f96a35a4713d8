"""The realistic mix's messages recorded once, as an engine's publisher frames them, for the ingest benchmarks."""

from __future__ import annotations

import gc

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


def freeze() -> None:
    """Take what the bench keeps (recorded frames, decoded batches: no replica's objects) out of the cyclic
    collector's walks, as a replica does with its start-up objects (gateway/server.py). Walked, they made
    the full collections cost up to 1 us per op, in whichever pass one happened to land. They stay frozen
    (freed by their reference counts when dropped): unfreezing would also release what a caller froze."""
    gc.collect()
    gc.freeze()
