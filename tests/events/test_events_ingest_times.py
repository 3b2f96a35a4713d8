"""Ingest's time by step (decode, keys, store, the rest), as the serving replica exports it for `kvmesh bench scale`:
each moment of a drain slice is counted once, in one step, and the sums reach `/metrics`."""

from __future__ import annotations

import itertools

import pytest
import trio
import zmq
from events_frames import live_frames, removed_map, stored_map
from prometheus_client import REGISTRY

from events import feed as feed_module
from events import socket_drain
from events.feed import EngineFeed
from events.ingest_budget import IngestBudget
from index import ingest as ingest_module
from index.ingest_times import INGEST_PROCESS_TIMES, INGEST_TIMES, STEPS, IngestTimes
from index.prefix_index import PrefixIndex
from index.view import CacheView

ENGINE = "ingest-times:8000"


def _feed() -> EngineFeed:
    view = CacheView(PrefixIndex())
    view.register(ENGINE, block_size=4, has_events=True)
    feed = EngineFeed(ENGINE, "m", view)
    feed.ingest.times = IngestTimes()
    return feed


@pytest.fixture
def ticking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read of the step clock is one second after the one before: a step's time is how many reads it spans."""
    reads = itertools.count()

    def clock() -> float:
        return float(next(reads))

    for module in (feed_module, ingest_module, socket_drain):
        monkeypatch.setattr(module, "step_clock", clock)


def test_a_stored_block_costs_decode_keys_and_store_and_a_removal_no_keys(ticking):
    feed = _feed()
    times = feed.ingest.times
    feed.on_live(live_frames(0, [stored_map([1, 2], None, list(range(8)), 4)]), 0.0)
    # reads: decode 0-1; apply 2..5 with the stored event's keys 3-4 inside it
    assert (times.decode_s, times.keys_s, times.applied_s) == (1.0, 1.0, 3.0)
    assert times.steps() == {"decode": 1.0, "keys": 1.0, "store": 2.0, "rest": 0.0}
    feed.on_live(live_frames(1, [removed_map([2])]), 0.0)
    assert (times.decode_s, times.keys_s, times.applied_s) == (2.0, 1.0, 4.0)
    feed.on_live([b"kv", (2).to_bytes(8, "big"), b"\xc1"], 0.0)  # refused: still decoding time
    assert times.decode_s == 3.0 and times.applied_s == 4.0


def test_an_orphan_is_charged_to_keys():
    feed = _feed()
    feed.on_live(live_frames(0, [stored_map([9], 77, [1, 2, 3, 4], 4)]), 0.0)  # parent 77 never stored
    assert feed.ingest.times.keys_s > 0 and feed.ingest.times.applied_s >= feed.ingest.times.keys_s


def test_a_drain_slice_counts_each_moment_once(ticking):
    """What decoding and applying did not take of a slice is its rest; the steps then sum to the slice."""
    feed = _feed()
    times = feed.ingest.times
    context = zmq.Context()
    reader, writer = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        reader.bind("inproc://ingest-times")
        writer.connect("inproc://ingest-times")
        writer.send_multipart(live_frames(0, [stored_map([1, 2], None, list(range(8)), 4)]))
        writer.send_multipart(live_frames(1, [removed_map([1])]))

        async def main() -> socket_drain.Drained:
            await trio.sleep(0.01)  # inproc delivers at once; let both arrive
            return socket_drain.drain_slice(reader, IngestBudget(slice_s=10.0), lambda f: feed.on_live(f, 0.0), feed)

        assert trio.run(main) is socket_drain.Drained.EMPTY
    finally:
        reader.close(0)
        writer.close(0)
        context.term()
    # reads: slice start 0; message 1: decode 1-2, apply 3-6 (keys 4-5); message 2: decode 7-8, apply 9-10; end 11
    assert times.steps() == {"decode": 2.0, "keys": 1.0, "store": 3.0, "rest": 5.0}
    assert sum(times.steps().values()) == 11.0


def _exported(process: str) -> dict[str, float | None]:
    return {step: REGISTRY.get_sample_value("kvmesh_ingest_seconds_total", {"process": process, "step": step})
            for step in STEPS}


def test_the_process_sums_are_exported_by_step():
    before = _exported("serving")
    assert before == INGEST_TIMES.steps() and _exported("ingest") == INGEST_PROCESS_TIMES.steps()
    view = CacheView(PrefixIndex())
    view.register(ENGINE, block_size=4, has_events=True)
    EngineFeed(ENGINE, "m", view).on_live(live_frames(0, [stored_map([5], None, [1, 2, 3, 4], 4)]), 0.0)
    after = _exported("serving")
    assert after == INGEST_TIMES.steps()
    assert after["decode"] > before["decode"] and after["keys"] > before["keys"]  # type: ignore[operator]


def test_another_processs_steps_add_up_as_its_own_would():
    times = IngestTimes()
    times.add_steps({"decode": 1.0, "keys": 2.0, "store": 3.0, "rest": 4.0})
    times.add_steps({"store": 0.5})
    assert times.steps() == {"decode": 1.0, "keys": 2.0, "store": 3.5, "rest": 4.0}

