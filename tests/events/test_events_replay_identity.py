"""Replays have identities: replies, end markers and failures of a replay the feed moved past change nothing."""

from __future__ import annotations

from events_frames import payload, stored_map

from events.feed import EngineFeed
from index.prefix_index import PrefixIndex
from index.view import CacheView

MODEL = "m"


def feed() -> EngineFeed:
    view = CacheView(PrefixIndex())
    view.register("e", block_size=4, has_events=True)
    return EngineFeed("e", MODEL, view)


def live(seq: int, first_hash: int) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), payload([stored_map([first_hash], None, [first_hash] * 4, 4)])]


def replayed(seq: int, first_hash: int) -> list[bytes]:
    return [b"", b"kv", seq.to_bytes(8, "big"), payload([stored_map([first_hash], None, [first_hash] * 4, 4)])]


END = [b"", b"", b"\xff" * 8, b""]


def held(f: EngineFeed) -> set[int]:
    return set(f.view.store.pairs("e"))


def test_a_restarted_publisher_ignores_the_old_publishers_late_replay():
    f = feed()
    assert f.on_live(live(5, 105), 0.0) == 0  # joined mid-stream: backfill from 0
    old = f.replay_generation
    assert f.on_live(live(2, 202), 0.0) == 0  # seq went back: the publisher restarted, replay again
    new = f.replay_generation
    assert new != old
    assert f.on_replay(replayed(3, 103), 0.0, old)  # the old publisher's late batches: stale, stop
    assert f.on_replay(END, 0.0, old)  # its end marker does not end the new replay
    assert f.replaying
    assert not f.on_replay(replayed(0, 200), 0.0, new)
    assert not f.on_replay(replayed(1, 201), 0.0, new)
    assert f.on_replay(END, 0.0, new)
    assert held(f) == {200, 201, 202}


def test_a_replay_ended_by_overflow_cannot_end_or_fail_its_successor():
    f = feed()
    f.tracker._max_buffered = 2
    assert f.on_live(live(0, 100), 0.0) is None
    assert f.on_live(live(3, 103), 0.0) == 1  # gap: replay 1 from seq 1
    first = f.replay_generation
    f.on_live(live(4, 104), 0.0)
    f.on_live(live(5, 105), 0.0)  # hold buffer overflows: replay 1 ends, its gap counted lost
    assert not f.replaying
    assert f.on_live(live(7, 107), 0.0) == 6  # a new gap: replay 2
    second = f.replay_generation
    f.on_replay_failed(0.0, first)  # replay 1's task times out only now
    assert f.replaying
    assert not f.on_replay(replayed(6, 106), 0.0, second)
    assert f.on_replay(END, 0.0, second)
    assert {106, 107} <= held(f)
    assert f.freshness.lost_batches == 2  # seqs 1 and 2, and nothing of replay 2


def test_an_engine_announcing_more_blocks_than_its_cache_holds_is_bounded_and_counted():
    view = CacheView(PrefixIndex())
    view.register("e", block_size=4, has_events=True, capacity_blocks=100)
    f = EngineFeed("e", MODEL, view)
    limit = view.info("e").block_limit()
    for seq in range(limit + 1):
        f.on_live(live(seq, 1000 + seq), 0.0)
        assert view.store.block_count("e") <= limit
    assert f.overflowed == 1
    assert f.freshness.lost_batches == 1
    f.on_live(live(limit + 1, 5), 1.0)
    assert view.store.block_count("e") == 1


def test_an_engine_announcing_more_offloaded_blocks_than_the_bound_loses_that_tier_only():
    """vLLM does not report its CPU tier's size: the index keeps up to TIER_LIMIT_FACTOR times the GPU limit
    of a tier, then drops that tier alone; the engine's GPU blocks stay."""
    from events.feed import TIER_LIMIT_FACTOR
    from index.tiers import tier_holder

    view = CacheView(PrefixIndex())
    view.register("e", block_size=4, has_events=True, capacity_blocks=10)
    f = EngineFeed("e", MODEL, view)
    f.on_live(live(0, 7), 0.0)
    bound = view.info("e").block_limit() * TIER_LIMIT_FACTOR
    per_event = 512
    seq, next_hash = 1, 10_000
    while view.store.block_count(tier_holder("e", "CPU")) + per_event <= bound:
        hashes = list(range(next_hash, next_hash + per_event))
        event = dict(stored_map(hashes, None, [1] * 4 * per_event, 4), medium="CPU")
        f.on_live([b"kv", seq.to_bytes(8, "big"), payload([event])], 0.0)
        seq, next_hash = seq + 1, next_hash + per_event
    assert f.overflowed == 0 and view.store.block_count(tier_holder("e", "CPU")) > bound - per_event
    hashes = list(range(next_hash, next_hash + per_event))
    f.on_live([b"kv", seq.to_bytes(8, "big"), payload([dict(stored_map(hashes, None, [1] * 4 * per_event, 4),
                                                            medium="CPU")])], 1.0)
    assert f.overflowed == 1 and f.freshness.lost_batches == 1
    assert view.store.block_count(tier_holder("e", "CPU")) == 0
    assert view.store.block_count("e") == 1


async def test_a_subscriber_that_hits_an_unexpected_error_is_restarted_not_fatal(monkeypatch, autojump_clock):
    """Whatever a publisher's frames make the feed raise, the engine's ingest restarts after a backoff."""
    import trio

    from events.discovery import EventSource
    from gateway import event_ingest

    calls = []

    async def exploding(feed, source, poller=None, config=None, before_ingest=None):
        calls.append(trio.current_time())
        raise KeyError("a bug a frame found")

    monkeypatch.setattr(event_ingest, "run_subscriber", exploding)
    f = feed()
    with trio.move_on_after(10.0):
        await event_ingest.supervised(f, EventSource("tcp://127.0.0.1:1", None, "kv"))
    assert [round(t - calls[0], 2) for t in calls] == [0.0, 0.5, 1.5, 3.5, 7.5]  # backing off
    assert f.freshness.lost_batches == len(calls)
