"""Where a process's KV-event ingest spends its time, by step: decode, keys, store and the rest.

``kvmesh bench ingest`` splits ingest's CPU per block op on recorded batches in process; in a serving replica
the same code costs more per op (other work on the loop, a larger index, caches shared with the rest of the
machine), and the split in place is what tells which step that is. These sums are exported as
``kvmesh_ingest_seconds_total{step}``, and ``kvmesh bench scale`` divides their growth over a window by the block
ops applied in it.

They are wall time of synchronous steps on one thread: nothing else runs on the loop meanwhile, so each is the
loop time the step took (a core taken away mid-step counts too; the bench prints that share beside it). A
read of ``time.perf_counter`` costs about 80 ns here against 770 for a thread CPU clock; reads come per
message and per stored event (about 0.09 stored events per block op on the realistic mix), about 1% of
ingest."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

step_clock = time.perf_counter
STEPS = ("decode", "keys", "store", "rest")
"""The exported steps, in order."""


@dataclass(slots=True)
class IngestTimes:
    """Sums in seconds; every field only grows, so each exported step is a counter."""

    decode_s: float = 0.0
    """Frames decoded into typed batches (``events.decode``)."""
    keys_s: float = 0.0
    """Own keys derived from stored events' tokens, their parents looked up (part of ``applied_s``)."""
    applied_s: float = 0.0
    """Decoded batches applied to the index: keys and the store's update."""
    rest_s: float = 0.0
    """The rest of each drain slice: receiving, ordering, freshness, counters and the budget's bookkeeping."""

    def steps(self) -> dict[str, float]:
        """Seconds per exported step; ``store`` is what applying took beyond the keys."""
        return dict(zip(STEPS, (self.decode_s, self.keys_s, max(0.0, self.applied_s - self.keys_s), self.rest_s),
                        strict=True))

    def add_steps(self, steps: Mapping[str, float]) -> None:
        """Add seconds by exported step (what another process's ``steps`` grew by)."""
        keys = steps.get("keys", 0.0)
        self.decode_s += steps.get("decode", 0.0)
        self.keys_s += keys
        self.applied_s += keys + steps.get("store", 0.0)
        self.rest_s += steps.get("rest", 0.0)

    def in_steps(self) -> float:
        """Decode and apply so far: a drain slice's rest is its time less what this grew by meanwhile."""
        return self.decode_s + self.applied_s


INGEST_TIMES = IngestTimes()
"""The process's sums: every feed and drain slice of the process adds to them."""
INGEST_PROCESS_TIMES = IngestTimes()
"""In a serving process whose ingest runs in a process of its own (``ingest_process = true``), what that process
reported of its own (it notes the growth of its ``INGEST_TIMES``, events/worker_notes.py)."""
