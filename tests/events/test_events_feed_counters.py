"""A feed counts its engine's batches and block ops into the process-wide counters, with the series it looked
up once; after the gateway drops an engine's series, the engine's next feed counts into fresh ones."""

from __future__ import annotations

from events_frames import live_frames, removed_map, stored_map
from prometheus_client import REGISTRY

from events.counters import BLOCK_OPS, EVENT_BATCHES
from events.feed import EngineFeed
from index.prefix_index import PrefixIndex
from index.view import CacheView

ENGINE = "feed-counters:8000"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"engine": ENGINE, **labels}) or 0.0


def test_a_feed_counts_per_engine_and_op_and_a_new_feed_after_the_series_were_dropped():
    view = CacheView(PrefixIndex())
    view.register(ENGINE, block_size=4, has_events=True)
    other = "feed-counters-other:8000"
    view.register(other, block_size=4, has_events=True)
    feed, bystander = EngineFeed(ENGINE, "m", view), EngineFeed(other, "m", view)
    feed.on_live(live_frames(0, [stored_map([1, 2], None, list(range(8)), 4)]), 0.0)
    bystander.on_live(live_frames(0, [stored_map([5], None, [9, 9, 9, 9], 4)]), 0.0)
    feed.on_live(live_frames(1, [removed_map([2]), stored_map([9], 77, [1, 2, 3, 4], 4)]), 0.0)
    assert sample("kvmesh_event_batches_total") == 2
    assert [sample("kvmesh_event_block_ops_total", op=op) for op in ("stored", "removed", "orphaned")] == [2, 1, 1]
    assert REGISTRY.get_sample_value("kvmesh_event_block_ops_total", {"engine": other, "op": "stored"}) == 1
    for metric in (EVENT_BATCHES, BLOCK_OPS):  # what the gateway does when the engine is removed
        metric.remove_by_labels({"engine": ENGINE})
    view.unregister(ENGINE)
    view.register(ENGINE, block_size=4, has_events=True)
    EngineFeed(ENGINE, "m", view).on_live(live_frames(0, [stored_map([3], None, [1, 1, 1, 1], 4)]), 0.0)
    assert sample("kvmesh_event_batches_total") == 1 and sample("kvmesh_event_block_ops_total", op="stored") == 1
