"""A data-parallel engine: one URL, one KV cache and one event stream per rank, each with its own seqs.

A restart (seq going back), a cleared cache or a lost publisher on one rank empties that rank's blocks
only; the engine holds a block when any rank does; a peer's snapshot carries each rank's blocks apart.
"""

from __future__ import annotations

import numpy as np
from events_frames import payload, stored_map

from events.feed import EngineFeed
from gateway import index_transfer
from index.block_hash import chain, root_seed
from index.holders import holder_keys
from index.prefix_index import PrefixIndex
from index.view import CacheView

MODEL = "m"
ENGINE = "10.0.0.5:8000"
BLOCK = 4


def dp_engine(ranks: int = 2) -> tuple[CacheView, list[EngineFeed]]:
    view = CacheView(PrefixIndex())
    view.register(ENGINE, block_size=BLOCK, has_events=True)
    holders = holder_keys(ENGINE, list(range(ranks)))
    view.set_holders(ENGINE, holders)
    return view, [EngineFeed(ENGINE, MODEL, view, holder=h) for h in holders]


def tokens(first: int, blocks: int) -> list[int]:
    return [first + i for i in range(blocks * BLOCK)]


def stored(seq: int, first: int, blocks: int = 2, rank: int = 0) -> list[bytes]:
    hashes = [first * 1000 + i for i in range(blocks)]
    event = stored_map(hashes, None, tokens(first, blocks), BLOCK)
    return [b"kv", seq.to_bytes(8, "big"), payload([event], rank=rank)]


def cleared(seq: int, rank: int) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), payload([{"type": "AllBlocksCleared"}], rank=rank)]


def overlap(view: CacheView, first: int, blocks: int = 2) -> int:
    prompt = chain(tokens(first, blocks), BLOCK, root_seed(MODEL, None, None))
    return view.overlaps({BLOCK: prompt}, [ENGINE], 0.0)[ENGINE].exact_blocks


def run(feed: EngineFeed, frames: list[list[bytes]]) -> None:
    for f in frames:
        assert feed.on_live(f, 0.0) is None


def test_one_rank_restarting_clears_that_rank_only():
    """Rank 0 at seq 6 and rank 1 at seq 2; rank 1's publisher restarts (its seq goes back to 0)."""
    view, (rank0, rank1) = dp_engine()
    run(rank0, [stored(seq, 10 + seq) for seq in range(7)])
    run(rank1, [stored(seq, 50 + seq, rank=1) for seq in range(3)])
    assert view.block_count(ENGINE) == 2 * 7 + 2 * 3
    run(rank1, [stored(0, 90, rank=1)])
    assert overlap(view, 90) == 2 and overlap(view, 50) == 0
    assert all(overlap(view, 10 + seq) == 2 for seq in range(7))
    assert view.block_count(ENGINE) == 2 * 7 + 2


def test_a_rank_that_clears_its_cache_keeps_the_other_ranks_blocks():
    view, (rank0, rank1) = dp_engine()
    run(rank0, [stored(0, 10)])
    run(rank1, [stored(0, 20, rank=1), cleared(1, rank=1)])
    assert overlap(view, 10) == 2 and overlap(view, 20) == 0


def test_a_lost_publisher_resets_its_own_rank_at_catch_up():
    view, (rank0, rank1) = dp_engine()
    run(rank0, [stored(0, 10)])
    run(rank1, [stored(0, 20, rank=1)])
    rank1.on_publisher_lost()
    assert rank1.catch_up(0.0) == 0
    assert overlap(view, 10) == 2 and overlap(view, 20) == 0


def test_the_engine_holds_what_any_rank_holds_and_one_source_is_the_engine_itself():
    view, (rank0, rank1) = dp_engine()
    run(rank0, [stored(0, 10, blocks=1)])
    run(rank1, [stored(0, 10, blocks=3, rank=1)])
    assert overlap(view, 10, blocks=3) == 3
    assert holder_keys(ENGINE, [0]) == (ENGINE,) and holder_keys(ENGINE, [3]) == (ENGINE,)
    hashes, own_keys = view.export(ENGINE)
    assert len(hashes) == len(own_keys) == 4
    view.unregister(ENGINE)
    assert view.store.engines() == []


def test_a_snapshot_carries_each_ranks_blocks_apart():
    view, (rank0, rank1) = dp_engine()
    run(rank0, [stored(0, 10), stored(1, 11)])
    run(rank1, [stored(0, 20, rank=1)])
    exported = [view.store.export(feed.holder) for feed in (rank0, rank1)]
    blob = index_transfer.encode([1, 0], [e[0] for e in exported], [e[1] for e in exported])
    snapshot = index_transfer.decode(blob, sources=2)
    assert snapshot.seqs == (1, 0) and snapshot.blocks == 6
    assert [len(h) for h in snapshot.hashes] == [4, 2]
    assert np.array_equal(snapshot.own_keys[1], exported[1][1])
