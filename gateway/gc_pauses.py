"""How long the cyclic garbage collector holds the process, per generation.

A full collection walks every tracked object the process made since start-up (``gateway/startup_objects.py``
freezes the rest); in a replica holding a large index, one such walk stops requests, health polls and KV-event
ingest together, and shows as a single late wake-up that a loop-lag percentile can miss. Timing each
collection names the cause when the index falls behind all at once.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class GcPauses:
    """A ``gc.callbacks`` entry that reports each collection's wall time and generation to ``observe``."""

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self._observe = observe
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self._observe(int(info.get("generation", 0)), time.perf_counter() - self._started)
            self._started = 0.0


@contextmanager
def timing_gc(observe: Callable[[int, float], None]) -> Iterator[GcPauses]:
    """Time every collection while the block runs (gc.callbacks is process-wide, so a finished replica
    removes its own entry and leaves other replicas' in place)."""
    pauses = GcPauses(observe)
    gc.callbacks.append(pauses)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(pauses)
