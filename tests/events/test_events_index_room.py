"""Room in the index is made ahead of ingest, in a worker thread, and adopted only over an index nobody wrote
meanwhile; the live poller asks for it before every slice it drains."""

from __future__ import annotations

import threading

import trio
import zmq

from events.counters import INDEX_REGROWN
from events.feed import EngineFeed
from events.index_room import RETRY_S, IndexRoom
from events.ingest_budget import IngestBudget
from events.live_poller import LivePoller, go_ahead
from index.prefix_index import LARGE_ALIASES, PrefixIndex
from index.view import CacheView
from tests.events.test_events_live_poller import Pair, feed, until


def regrown(outcome: str) -> float:
    return INDEX_REGROWN.labels(outcome=outcome)._value.get()


def filled(blocks: int) -> PrefixIndex:
    index = PrefixIndex()
    index.store_many("a", list(range(1, blocks + 1)), list(range(10_001, 10_001 + blocks)))
    return index


async def test_an_index_short_of_room_gets_a_doubled_table_with_every_block():
    index, adopted = filled(19_000), regrown("adopted")
    room = IndexRoom(index, blocks=5000)
    assert index.needs_room(5000)
    await room.make()
    assert not index.needs_room(5000) and regrown("adopted") == adopted + 1
    assert index.overlap(list(range(10_001, 29_001))) == {"a": 19_000}
    await room.make()  # room enough: nothing built
    assert regrown("adopted") == adopted + 1


async def test_a_small_index_at_its_cap_is_not_regrown_and_shrunk_over_and_over():
    """An engine at its KV capacity stores and evicts every slice. Room for a fixed 65,536 blocks doubled a
    4,000-block table before each slice and the next removals shrank it again, on the loop."""
    index, adopted = filled(4000), regrown("adopted")
    room = IndexRoom(index)
    sizes = [index._masks._size]
    oldest, newest = 1, 4000
    for _ in range(20):
        await room.make()
        sizes.append(index._masks._size)
        fresh = list(range(newest + 1, newest + 201))
        index.store_many("a", fresh, [10**6 + key for key in fresh])
        index.remove("a", list(range(oldest, oldest + 200)))
        sizes.append(index._masks._size)
        oldest, newest = oldest + 200, newest + 200
    assert len({*sizes}) <= 2 and sizes == sorted(sizes) and regrown("adopted") <= adopted + 1
    assert index.block_count("a") == 4000 and index.overlap([10**6 + newest]) == {"a": 1}


async def test_a_write_while_the_table_is_built_leaves_it_stale_and_the_next_try_adopts():
    index, stale = filled(19_000), regrown("stale")
    room = IndexRoom(index, blocks=5000)
    building, written = threading.Event(), threading.Event()
    build = index.regrown

    def held_build(blocks: int, holders):
        building.set()
        written.wait(5)
        return build(blocks, holders)

    async def write_meanwhile() -> None:
        await trio.to_thread.run_sync(building.wait, 5)
        index.store_many("b", [1, 2], [10_001, 99])
        written.set()

    index.regrown = held_build

    async with trio.open_nursery() as nursery:
        nursery.start_soon(room.make)
        nursery.start_soon(write_meanwhile)
    del index.regrown
    assert regrown("stale") == stale + 1 and index.needs_room(5000)
    assert index.overlap([10_001, 10_002]) == {"a": 2, "b": 1} and index.overlap([99]) == {"b": 1}
    await room.make()
    assert not index.needs_room(5000) and index.overlap([99]) == {"b": 1}


async def test_a_failed_build_is_counted_and_tried_again_only_after_a_wait(monkeypatch, autojump_clock):
    index, failed = filled(19_000), regrown("failed")
    room = IndexRoom(index, blocks=5000)

    def no_memory(blocks: int, holders):
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(index, "regrown", no_memory)
    await room.make()
    await room.make()
    assert regrown("failed") == failed + 1
    await trio.sleep(RETRY_S)
    await room.make()
    assert regrown("failed") == failed + 2
    index.store_many("a", [90_000], [90_000])  # stores still double the table themselves
    assert index.overlap([90_000]) == {"a": 1}


async def test_the_poller_makes_room_before_it_drains_a_slice():
    context = zmq.Context()
    pair = Pair(context)
    order: list[str] = []

    async def room(feed) -> None:
        order.append("room")

    def handle(frames: list[bytes]) -> None:
        order.append("slice")

    poller = LivePoller(IngestBudget(), tick_s=0.005, quiet_ticks=4, room=room)
    try:
        await pair.settle()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            nursery.start_soon(poller.hand_over, pair.sub, handle, feed(), trio.current_time, go_ahead)
            await until(lambda: poller.handed() == 1)
            for n in range(3):
                pair.pub.send(b"m%d" % n)
            await until(lambda: order.count("slice") >= 1)
            nursery.cancel_scope.cancel()
    finally:
        pair.close()
        context.term()
    assert order[0] == "room" and "slice" in order


async def test_a_large_alias_table_full_of_tombstones_is_swept_ahead_of_its_engines_slice():
    """An engine's removals leave tombstones in its alias table; before a slice of that engine, the table is
    rebuilt without them in a worker thread, and lookups and removals still see every block."""
    index = PrefixIndex()
    view = CacheView(index)
    view.register("a", block_size=4, has_events=True)
    blocks = 30_000
    index.store_many("a", list(range(1, blocks + 1)), list(range(10**6, 10**6 + blocks)))
    aliases = index._aliases["a"]
    assert aliases._size >= LARGE_ALIASES
    live = list(range(1, blocks + 1))
    for churn in range(200):  # removals leave tombstones, stores take fresh slots (or reuse some tombstones)
        if aliases.rebuilds_soon(LARGE_ALIASES):
            break
        gone, live = live[:1000], live[1000:]
        fresh = list(range(10**7 + 1000 * churn, 10**7 + 1000 * (churn + 1)))
        index.remove("a", gone)
        index.store_many("a", fresh, [2 * 10**6 + key for key in fresh])
        live += fresh
    assert index.needs_room(1, ["a"]) and not index.needs_room(1)
    held = index.pairs("a")
    await IndexRoom(index, blocks=1).make(EngineFeed("a", "tiny", view))
    swept = index._aliases["a"]
    assert swept._used == len(swept) == len(held) and not index.needs_room(1, ["a"])
    assert index.pairs("a") == held
    assert index.remove("a", list(held)[:10]) == 10
