"""The ingest process's notes (events/worker_notes.py, index/key_ledger.py): what the serving side builds from
them is what ingest on its own loop would have built, and a malformed message is refused whole."""

from __future__ import annotations

import msgpack
import pytest
from events_frames import live_frames, removed_map, stored_map
from hypothesis import given
from hypothesis import strategies as st

from events.feed import EngineFeed
from events.worker_notes import (
    NotedFreshness,
    NotedView,
    NotesError,
    TimeDeltas,
    apply_notes,
    decode_notes,
    encode_notes,
    split_notes,
)
from index.ingest_times import INGEST_PROCESS_TIMES, IngestTimes
from index.key_ledger import KeyLedger
from index.prefix_index import PrefixIndex
from index.tiers import TIER_MEDIA, tier_holder
from index.view import CacheView

BLOCK = 4
MODEL = "tiny"
ENGINE = "e0"
OTHER = "e1"


def _stored(hashes, parent, first_token, medium="GPU"):
    tokens = [first_token * 16 + i for i in range(BLOCK * len(hashes))]
    event = stored_map(hashes, parent, tokens, BLOCK)
    event["medium"] = medium
    return event


@st.composite
def streams(draw):
    """Batches of one engine's stream: chains grown from held blocks or roots, evictions, offloads, resets."""
    held: list[int] = []
    next_hash = 1
    batches = []
    for _ in range(draw(st.integers(1, 12))):
        events = []
        for _ in range(draw(st.integers(1, 5))):
            kind = draw(st.sampled_from(["store", "store", "store", "remove", "cpu", "clear"]))
            if kind in ("store", "cpu"):
                count = draw(st.integers(1, 6))
                parent = draw(st.sampled_from([None, *held[-8:]])) if held else None
                hashes = list(range(next_hash, next_hash + count))
                next_hash += count
                events.append(_stored(hashes, parent, draw(st.integers(0, 3)), "GPU" if kind == "store" else "CPU"))
                if kind == "store":
                    held += hashes
            elif kind == "remove" and held:
                gone = draw(st.lists(st.sampled_from(held), min_size=1, max_size=4, unique=True))
                events.append(removed_map(gone))
                held = [h for h in held if h not in gone]
            elif kind == "clear":
                events.append({"type": "AllBlocksCleared"})
                held = []
        batches.append(events)
    return batches


def _loop_side():
    view = CacheView(PrefixIndex())
    for engine in (ENGINE, OTHER):
        view.register(engine, block_size=BLOCK, has_events=True)
    return view


def _worker_side():
    ledger = KeyLedger()
    view = NotedView(ledger, ledger.notes)
    view.register(ENGINE, block_size=BLOCK, has_events=True)
    feed = EngineFeed(ENGINE, MODEL, view)
    feed.freshness = NotedFreshness(ENGINE, ENGINE, ledger.notes)
    return ledger, feed


@given(streams(), st.lists(st.booleans(), min_size=12, max_size=12), st.integers(0, 11))
def test_the_serving_index_built_from_notes_equals_ingest_on_its_own_loop(batches, flush_after, gap_at):
    loop_view = _loop_side()
    loop_feed = EngineFeed(ENGINE, MODEL, loop_view)
    # another engine shares blocks, so the serving side's masks hold more than one holder
    shared = EngineFeed(OTHER, MODEL, loop_view)
    served = _loop_side()
    shared_served = EngineFeed(OTHER, MODEL, served)
    ledger, worker_feed = _worker_side()
    applied: dict[str, int] = {}

    def flush():
        if ledger.notes:
            apply_notes(decode_notes(encode_notes(ledger.notes)), served, {ENGINE}.__contains__, applied, 1.0)
            ledger.notes.clear()

    for seq, events in enumerate(batches):
        seq_sent = seq + 1 if seq >= gap_at else seq  # one seq skipped: both sides see the gap alike
        frames = live_frames(seq_sent, events)
        assert loop_feed.on_live(frames, 1.0) == worker_feed.on_live(frames, 1.0)
        if seq == 0:
            mirror = live_frames(0, [_stored([900, 901], None, 0)])
            shared.on_live(mirror, 1.0)
            shared_served.on_live(mirror, 1.0)
        if flush_after[seq % len(flush_after)]:
            flush()
    flush()

    loop_store, served_store = loop_view.store, served.store
    for holder in (ENGINE, OTHER, *(tier_holder(ENGINE, m) for m in TIER_MEDIA)):
        loop_pairs, served_pairs = loop_store.pairs(holder), served_store.pairs(holder)
        assert served_pairs == loop_pairs
        assert served_store.block_count(holder) == loop_store.block_count(holder)
        if holder in (ENGINE, OTHER):
            assert ledger.block_count(holder) == (loop_store.block_count(holder) if holder == ENGINE else 0)
    assert served_store.unique_blocks() == loop_store.unique_blocks()
    chain = list(loop_store.pairs(ENGINE).values())
    assert served_store.overlap(chain) == loop_store.overlap(chain)
    loop_fresh, served_fresh = loop_view.info(ENGINE).freshness, served.info(ENGINE).freshness
    assert (served_fresh.last_seq, served_fresh.gaps, served_fresh.resets) == \
        (loop_fresh.last_seq, loop_fresh.gaps, loop_fresh.resets)
    assert applied.get(ENGINE) == loop_feed.applied_seq()


def test_the_ingest_processs_times_reach_the_serving_side_by_step_once():
    """What the ingest process's steps grew by is noted once a second, and exported as its process's times."""
    worker = IngestTimes()
    deltas = TimeDeltas(worker)
    assert deltas.notes() == []
    worker.add_steps({"decode": 0.25, "keys": 0.5, "store": 1.0})
    first = deltas.notes()
    assert first == [("t", "decode", 0.25), ("t", "keys", 0.5), ("t", "store", 1.0)]
    worker.add_steps({"rest": 0.125})
    assert deltas.notes() == [("t", "rest", 0.125)]  # only what grew since
    before = INGEST_PROCESS_TIMES.steps()
    apply_notes(decode_notes(encode_notes(first)), _loop_side(), set().__contains__, {}, 1.0)
    after = INGEST_PROCESS_TIMES.steps()
    assert {step: after[step] - before[step] for step in after} == {"decode": 0.25, "keys": 0.5, "store": 1.0,
                                                                    "rest": 0.0}


def test_notes_of_an_engine_no_longer_ingested_change_nothing():
    ledger, feed = _worker_side()
    feed.on_live(live_frames(0, [_stored([1, 2], None, 0)]), 1.0)
    served = _loop_side()
    applied: dict[str, int] = {}
    apply_notes(decode_notes(encode_notes(ledger.notes)), served, set().__contains__, applied, 1.0)
    assert served.store.block_count(ENGINE) == 0
    assert applied == {}


@pytest.mark.parametrize("frames", [
    [],
    [b"\xc1"],
    [msgpack.packb({"s": 1})],
    [msgpack.packb([["s", "e0", 1]])],  # carries words the message does not have
    [msgpack.packb([["s", "e0", 1]]), b"\x01" * 8],  # hashes without their own keys
    [msgpack.packb([["r", "e0", 1]]), b"\x01" * 16],  # words no note names
    [msgpack.packb([["r", "e0", -1]]), b"\x01" * 8],
    [msgpack.packb([["r", "e0", 1]]), b"\x01" * 8, b"\x01" * 8],  # an array frame per note
    [msgpack.packb([]), b""],
    [msgpack.packb([["r", "e0", 1]]), b"\x01" * 7],
    [msgpack.packb([["r", "e0", 1]]), b"\xff" * 8],  # past the index's key range
    [msgpack.packb([["e", "e0", "e0", -1]])],
    [msgpack.packb([["q", "e0"]])],
    [msgpack.packb([["n", "not_a_counter", [], 1]])],
    [msgpack.packb([["n", "kvmesh_event_replays", ["e0", "x"], float("nan")]])],
    [msgpack.packb([["c", ""]])],
    [msgpack.packb([["t", "parse", 0.5]])],  # no such ingest step
    [msgpack.packb([["t", "decode", -0.5]])],
    [msgpack.packb([["t", "decode", float("inf")]])],
    [msgpack.packb([["t", "decode"]])],
])
def test_a_malformed_message_is_refused_whole(frames):
    with pytest.raises(NotesError):
        decode_notes(frames)


@given(st.lists(st.tuples(st.sampled_from(["s", "r", "i", "e", "g"]), st.integers(0, 700)), max_size=40),
       st.integers(1, 1000))
def test_notes_cut_into_parts_keep_their_order_and_a_bounded_size(shapes, ops):
    """The serving loop applies a message at once: parts stay near ``ops`` block ops, none lost or reordered."""
    notes = [(kind, "h", list(range(n)), list(range(n))) if kind == "s" else (kind, "h", list(range(n)), 0)
             for kind, n in shapes]
    parts = list(split_notes(notes, ops))
    assert [note for part in parts for note in part] == notes
    for part in parts:
        carried = [len(note[2]) for note in part if note[0] in ("s", "r", "i")]
        assert sum(carried[:-1]) < ops  # only the note that crossed the line may carry past it


def test_a_message_carries_every_notes_words_in_one_array_frame():
    notes = [("s", "e0", [1, 2], [10, 20]), ("e", "e0", "e0", 4), ("r", "e0", [2]), ("i", "e0", [], 1),
             ("i", "e0", [10], 0), ("c", "e1"), ("s", "e1", [3], [30])]
    frames = encode_notes(notes)
    assert len(frames) == 2
    decoded = decode_notes(frames)
    assert [(n.kind, n.name, n.hashes.tolist(), n.keys.tolist()) for n in decoded] == [
        ("s", "e0", [1, 2], [10, 20]), ("e", "e0", [], []), ("r", "e0", [2], []), ("i", "e0", [], []),
        ("i", "e0", [], [10]), ("c", "e1", [], []), ("s", "e1", [3], [30])]
    assert (decoded[1].holder, decoded[1].number, decoded[3].number) == ("e0", 4, 1)
    assert len(encode_notes([("e", "e0", "e0", 4)])) == 1


_NOTE_ITEMS = st.lists(st.one_of(
    st.integers(-2, 3), st.text(max_size=3), st.none(), st.booleans(), st.floats(allow_nan=True),
    st.sampled_from(["s", "r", "i", "c", "e", "n", "t", "decode", "e0"])), max_size=5)


@given(st.lists(_NOTE_ITEMS, max_size=6), st.lists(st.binary(max_size=40), max_size=3))
def test_any_message_decodes_to_notes_or_is_refused_with_a_notes_error(items, arrays):
    """The serving side reads what its child sends as untrusted: whatever the list and frames, a message either
    decodes whole, every note's words a view of the array frame, or raises NotesError."""
    frames = [msgpack.packb(items), *arrays]
    try:
        notes = decode_notes(frames)
    except NotesError:
        return
    carried = sum(len(note.hashes) + len(note.keys) for note in notes)
    assert carried == (len(arrays[0]) // 8 if arrays else 0)
