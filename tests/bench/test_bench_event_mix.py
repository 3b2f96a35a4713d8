"""The realistic event mix: what a replica ingests from it is exactly the live set the engine states."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import bench.revision
from bench.event_mix import BLOCK_SIZE, MAX_PREFILL_BLOCKS, EventTemplates, MixEngine
from bench.ingest_cost import _TOTAL, measure, twinned
from bench.ingest_split import warmed_fleet
from bench.ingest_zmq import measure_over_zmq
from bench.recorded_events import recorded_mix
from bench.revision import pass_in, side_by_side
from events.feed import EngineFeed
from index.digest import block_set_digest
from index.prefix_index import PrefixIndex
from index.view import CacheView
from sim.event_encoding import encode_batch
from sim.kv_cache import BlockRemoved, BlockStored


def test_an_exact_replica_ingesting_the_mix_reports_the_engines_digest():
    engine = MixEngine(3, cap=2 * MAX_PREFILL_BLOCKS, model="m", seed=5)
    view = CacheView(PrefixIndex())
    view.register("e", block_size=16, has_events=True)
    feed = EngineFeed("e", "m", view)
    stored = removed = 0
    for seq in range(300):
        batch = engine.next_batch(0.0)
        stored, removed = stored + batch.stored, removed + batch.removed
        feed.on_live([b"kv", seq.to_bytes(8, "big"), batch.payload], 0.0)
    assert engine.full and removed > 0 and stored > removed
    assert feed.totals.orphaned == 0 and feed.totals.stored == stored and feed.totals.removed == removed
    assert block_set_digest(*view.store.export("e")) == engine.digest()


def test_ingest_cost_splits_the_cpu_per_block_op():
    cost = measure(engines=2, cap=2 * MAX_PREFILL_BLOCKS, steps=5)
    assert cost.ops > 0 and cost.live_blocks > 0
    assert min(cost.decode_us, cost.keys_us) > 0 and cost.total_us >= cost.decode_us + cost.keys_us


def test_a_replicated_fleet_holds_every_block_twice_and_counts_both_engines_ops():
    """Each twin is sent its engine's messages: the same live blocks, none unique to one engine, twice the ops."""
    single = measure(engines=2, cap=2 * MAX_PREFILL_BLOCKS, steps=5, passes=1)
    cost = measure(engines=2, cap=2 * MAX_PREFILL_BLOCKS, steps=5, passes=1, replicated=True)
    assert cost.ops == 2 * single.ops and cost.live_blocks == 2 * single.live_blocks
    assert "2 engines and a twin of each" in cost.line()
    messages = recorded_mix(2, 2 * MAX_PREFILL_BLOCKS, 5, 0)
    view, _ = warmed_fleet(4, twinned(messages.fill, 2))
    store = view.store
    assert store.unique_blocks() == {} and len(store) == store.block_count("e0") + store.block_count("e1")
    assert store.pairs("e0") == store.pairs("e2") and store.pairs("e1") == store.pairs("e3")


def test_a_pass_in_a_fresh_process_reports_its_cpu_per_block_op():
    command = ["-m", "bench.ingest_cost", "--engines", "2", "--cap", str(2 * MAX_PREFILL_BLOCKS), "--steps", "3"]
    assert 0 < pass_in(None, command, _TOTAL) < 1e4


def test_two_codes_alternate_which_goes_first_and_are_compared_pair_by_pair(monkeypatch, tmp_path):
    runs = []
    figures = iter([4.0, 5.0, 6.0, 4.5, 5.0, 5.0])

    def one_pass(tree, command, figure):
        runs.append("other" if tree else "this")
        return next(figures)
    monkeypatch.setattr(bench.revision, "exported", lambda rev, into: tmp_path / rev)
    monkeypatch.setattr(bench.revision, "pass_in", one_pass)
    lines = side_by_side("HEAD~1", 3, [], _TOTAL, "us per op", tmp_path)
    assert runs == ["this", "other", "other", "this", "this", "other"]
    assert lines[0] == "this code     us per op: 4.00 4.50 5.00 (median 4.50)"
    assert lines[2] == "HEAD~1 / this code per pair: 1.250 1.333 1.000 (median 1.250)"


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["map", "array"]), st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4),
       st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.integers(0, 2**64 - 1), st.integers(0, 3))
def test_templated_events_encode_exactly_as_the_simulated_engines_encoder(encoding, hashes, parent, removed, rank):
    """The mix fills copies of the encoder's own events; the bytes must be what the encoder writes."""
    templates = EventTemplates(encoding)
    tokens = [(h * 7 + i) % 151_000 for h in range(len(hashes)) for i in range(BLOCK_SIZE)]
    as_bytes = [h.to_bytes(8, "big") for h in hashes]
    expected = [BlockStored(as_bytes, None if parent is None else parent.to_bytes(8, "big"), tokens, BLOCK_SIZE,
                            [None] * len(hashes)), BlockRemoved([removed.to_bytes(8, "big")])]
    events = [templates.stored(hashes, parent, tokens), templates.removed(removed)]
    assert EventTemplates.batch(1.5, events, rank) == encode_batch(1.5, expected, encoding, rank)


def test_over_zmq_every_published_op_reaches_the_replicas_subscribers():
    """The ZeroMQ pass ends only once every engine's last message was applied (else it times out), and prints the
    figure ``--against`` compares."""
    line = measure_over_zmq(engines=2, cap=2 * MAX_PREFILL_BLOCKS, steps=3, rate=400.0)
    match = _TOTAL.search(line)
    assert match is not None and float(match.group(1)) > 0
    assert "all applied" in line
