"""Offloaded tiers: CPU/STORAGE events are indexed per medium and found after an engine's GPU prefix."""

from __future__ import annotations

import sys
from pathlib import Path

from events.decode import decode_payload
from index.block_hash import chain, root_seed
from index.holders import engine_of
from index.ingest import EngineIngest
from index.prefix_index import PrefixIndex
from index.tiers import TierRun, tier_holder
from index.view import CacheView

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "events"))
from events_frames import payload, stored_map  # noqa: E402

MODEL = "tiny"
TOKENS = list(range(24))
CHAIN = chain(TOKENS, 4, root_seed(MODEL))  # 6 blocks


def tiered(medium: str, first: int, last: int) -> dict:
    """Blocks first..last-1 of TOKENS as an offloading connector announces them in ``medium``."""
    parent = None if first == 0 else 100 + first - 1
    event = stored_map([100 + i for i in range(first, last)], parent, TOKENS[first * 4 : last * 4], 4)
    return dict(event, medium=medium)


def removed(medium: str, blocks: range) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [100 + i for i in blocks], "medium": medium}


def fed_view() -> tuple[CacheView, EngineIngest]:
    view = CacheView(PrefixIndex())
    view.register("e1", block_size=4, has_events=True)
    view.info("e1").freshness.on_events(0.0, 0)
    return view, EngineIngest("e1", MODEL, view.store)


def test_cpu_blocks_after_the_gpu_prefix_are_one_run_and_do_not_count_as_gpu_hits():
    view, ingest = fed_view()
    ingest.apply(decode_payload(0, payload([tiered("GPU", 0, 2), tiered("CPU", 0, 5)])))
    found = view.overlaps({4: CHAIN}, ["e1"], now=0.0)["e1"]
    assert found.exact_blocks == 2
    assert found.tiers == (TierRun("CPU", 3),)
    assert view.block_count("e1") == 2, "the GPU cache's size (what eviction is priced on) excludes tiers"


def test_nearest_tier_serves_each_block_and_a_gap_ends_the_runs():
    view, ingest = fed_view()
    events = [tiered("STORAGE", 0, 6), tiered("CPU", 1, 3), removed("STORAGE", range(4, 5))]
    ingest.apply(decode_payload(0, payload(events)))
    found = view.overlaps({4: CHAIN}, ["e1"], now=0.0)["e1"]
    assert found.exact_blocks == 0
    assert found.tiers == (TierRun("STORAGE", 1), TierRun("CPU", 2), TierRun("STORAGE", 1))


def test_a_tier_block_chains_on_a_parent_only_the_gpu_announced():
    view, ingest = fed_view()
    stats = ingest.apply(decode_payload(0, payload([tiered("GPU", 0, 3), tiered("CPU", 3, 6)])))
    assert stats.orphaned == 0
    assert view.overlaps({4: CHAIN}, ["e1"], now=0.0)["e1"].tiers == (TierRun("CPU", 3),)


def test_cpu_removal_reset_and_unregister_clear_the_tier():
    view, ingest = fed_view()
    ingest.apply(decode_payload(0, payload([tiered("CPU", 0, 6)])))
    stats = ingest.apply(decode_payload(1, payload([removed("CPU", range(3, 6))])))
    assert stats.removed == 3
    assert view.overlaps({4: CHAIN}, ["e1"], now=0.0)["e1"].tiers == (TierRun("CPU", 3),)
    ingest.apply(decode_payload(2, payload([["AllBlocksCleared"]])))
    assert view.store.block_count(tier_holder("e1", "CPU")) == 3, "a GPU reset leaves the offloaded copies"
    assert ingest.reset() == 3 and view.store.block_count(tier_holder("e1", "CPU")) == 0
    ingest.apply(decode_payload(0, payload([tiered("CPU", 0, 6)])))
    view.unregister("e1")
    assert view.store.block_count(tier_holder("e1", "CPU")) == 0


def test_a_gpu_only_engine_has_no_tier_runs():
    view, ingest = fed_view()
    ingest.apply(decode_payload(0, payload([tiered("GPU", 0, 6)])))
    assert view.overlaps({4: CHAIN}, ["e1"], now=0.0)["e1"].tiers == ()


def test_placeholder_events_of_a_connector_without_self_describing_events_are_skipped_not_fatal():
    placeholder = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [],
                   "block_size": 0, "medium": "CPU"}
    batch = decode_payload(0, payload([placeholder, tiered("GPU", 0, 2)]))
    assert batch.unknown_events == 1 and len(batch.events) == 1


def test_an_engines_tier_blocks_belong_to_the_engine():
    assert engine_of(tier_holder("e1", "CPU")) == "e1"
    assert engine_of(tier_holder("e1#dp2", "STORAGE")) == "e1"
    store = PrefixIndex()
    ingest = EngineIngest("e1", MODEL, store)
    ingest.apply(decode_payload(0, payload([tiered("GPU", 0, 2), tiered("CPU", 0, 4)])))
    assert store.unique_blocks() == {"e1": 4}
