"""CacheView, approximate/speculative entries and freshness-derived confidence (time passed in)."""

from __future__ import annotations

from index.approximate import ApproximateIndex
from index.block_hash import chain, root_seed
from index.freshness import EngineFreshness, FreshnessPolicy
from index.ingest import IngestStats
from index.prefix_index import PrefixIndex
from index.view import CacheView

SEED = root_seed("m")


def test_overlaps_combine_exact_speculative_and_approximate_per_block_size():
    tokens = list(range(64))
    chains = {16: chain(tokens, 16, SEED), 32: chain(tokens, 32, SEED)}
    view = CacheView(PrefixIndex(), speculative_ttl_s=5.0, approximate_ttl_s=100.0)
    view.register("ev", block_size=16, has_events=True)
    view.register("plain", block_size=32, has_events=False, capacity_blocks=10)
    view.store.store("ev", [(1, chains[16][0])])
    view.info("ev").freshness.on_events(0.0, 0)
    view.record_dispatch("ev", chains, now=0.0)
    view.record_dispatch("plain", chains, now=0.0)
    got = view.overlaps(chains, ["ev", "plain", "unknown"], now=1.0)
    assert set(got) == {"ev", "plain"}
    assert (got["ev"].exact_blocks, got["ev"].approx_blocks, got["ev"].block_size) == (1, 4, 16)
    assert (got["plain"].exact_blocks, got["plain"].approx_blocks) == (0, 2)
    later = view.overlaps(chains, ["ev", "plain"], now=6.0)
    assert later["ev"].approx_blocks == 1 and later["plain"].approx_blocks == 2
    view.on_ingest("ev", IngestStats(stored_keys=chains[16][:2]))
    assert view.overlaps(chains, ["ev"], now=2.0)["ev"].approx_blocks == 1
    view.record_dispatch("ev", chains, now=10.0)
    view.on_reset("ev")
    assert view.overlaps(chains, ["ev"], now=10.0)["ev"].approx_blocks == 1


def test_approximate_lru_is_bounded_by_capacity():
    approx = ApproximateIndex()
    approx.set_capacity("e", 3)
    approx.record("e", [1, 2, 3], now=0.0, ttl_s=10.0)
    approx.record("e", [4, 5], now=0.0, ttl_s=10.0)
    assert approx.size("e") == 3
    assert approx.leading("e", [3, 4, 5], now=1.0) == 3
    assert approx.leading("e", [1, 2], now=1.0) == 0
    assert approx.leading("e", [3, 4], now=11.0) == 0


def test_silence_only_decays_confidence_while_the_engine_is_busy():
    policy = FreshnessPolicy(silence_grace_s=1.0, silence_half_life_s=10.0, poll_stale_s=5.0)
    idle = EngineFreshness(policy=policy)
    idle.on_events(0.0, 1)
    for t in range(0, 60, 1):
        idle.on_poll(float(t), running=0)
    assert idle.confidence(60.0) == 1.0

    busy = EngineFreshness(policy=policy)
    busy.on_events(0.0, 1)
    busy.on_poll(30.0, running=0)
    busy.on_poll(31.0, running=3)
    assert busy.confidence(32.0) == 1.0
    busy.on_poll(36.0, running=3)
    busy.on_poll(41.0, running=2)
    assert abs(busy.confidence(42.0) - 0.5) < 1e-9
    busy.on_events(42.0, 2)
    assert busy.confidence(42.5) == 1.0

    stale_poll = EngineFreshness(policy=policy)
    stale_poll.on_events(0.0, 1)
    stale_poll.on_poll(0.0, running=0)
    assert stale_poll.confidence(100.0) < 0.01


def test_lost_batches_and_ingest_falling_behind_lower_confidence_until_recovered():
    f = EngineFreshness(policy=FreshnessPolicy(loss_penalty=0.5, loss_recovery_s=30.0, silence_grace_s=1e9))
    assert f.confidence(0.0) == 0.0
    f.on_events(0.0, 0)
    f.on_lost(0.0, 3)
    assert f.confidence(0.0) == 0.5 and f.lost_batches == 3
    assert abs(f.confidence(15.0) - 0.75) < 1e-9
    assert f.confidence(30.0) == 1.0
    f.on_deferred(30.0)
    assert f.confidence(30.0) == 0.5
    assert f.confidence(40.0) < 0.5
    f.on_deferred(35.0)  # still the same episode: it does not restart the decay
    assert f.confidence(40.0) == 0.25
    f.on_caught_up()
    assert f.confidence(41.0) == 1.0
    assert EngineFreshness(has_events=False).confidence(5.0) == 1.0  # nothing from events to doubt
