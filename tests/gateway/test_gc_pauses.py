"""Each garbage collection is timed while a replica runs, and only then."""

from __future__ import annotations

import gc

from gateway.gc_pauses import timing_gc


def test_a_full_collection_is_reported_with_its_generation_and_time():
    seen: list[tuple[int, float]] = []
    with timing_gc(lambda generation, pause_s: seen.append((generation, pause_s))):
        gc.collect(2)
        gc.collect(0)
    assert (2, seen[0][1]) in seen and any(generation == 0 for generation, _ in seen)
    assert all(pause_s >= 0 for _, pause_s in seen)


def test_a_finished_replica_leaves_no_callback_and_others_in_place():
    seen: list[int] = []
    other: list[int] = []
    with timing_gc(lambda generation, _: other.append(generation)):
        with timing_gc(lambda generation, _: seen.append(generation)):
            pass
        gc.collect(1)
    assert seen == [] and 1 in other
    reported = len(other)
    gc.collect(1)
    assert len(other) == reported
