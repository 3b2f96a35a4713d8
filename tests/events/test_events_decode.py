"""Decoding: both encodings, both hash forms, and nothing but DecodeError on arbitrary input."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from events_frames import live_frames, removed_array, removed_map, stored_array, stored_map
from hypothesis import given, settings
from hypothesis import strategies as st

from events.decode import DecodeError, ReplayEnd, decode_live, decode_payload, decode_replay
from index.block_hash import KEY_MASK
from index.events import AllBlocksCleared, BlockRemoved, BlockStored


@pytest.mark.parametrize("build_stored,build_removed", [(stored_map, removed_map), (stored_array, removed_array)])
def test_both_encodings_decode_to_the_same_events(build_stored, build_removed):
    frames = live_frames(7, [build_stored([2**64 - 1, 5], None, list(range(8)), 4, lora_name="ad"),
                             build_removed([5]), ["AllBlocksCleared"], {"type": "FutureEvent"}])
    batch = decode_live(frames)
    assert batch.seq == 7 and batch.unknown_events == 1
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == ((2**64 - 1) & KEY_MASK, 5)
    assert stored.token_ids == tuple(range(8)) and stored.lora_name == "ad" and stored.medium == "GPU"
    assert removed == BlockRemoved((5,), "GPU", None)
    assert cleared == AllBlocksCleared()


def test_bytes_hashes_match_vllm_int_conversion():
    raw = bytes(range(32))
    batch = decode_live(live_frames(0, [stored_map([raw], raw, [1, 2], 2)]))
    expected = int.from_bytes(raw, "big") & (2**64 - 1) & KEY_MASK
    assert batch.events[0].block_hashes == (expected,)
    assert batch.events[0].parent_block_hash == expected


def test_replay_frames_new_and_old_forms_and_end_marker():
    body = msgpack.packb([0.5, [removed_map([1])], 0])
    assert decode_replay([b"", b"kv", (3).to_bytes(8, "big"), body]).seq == 3
    assert decode_replay([b"", (4).to_bytes(8, "big"), body]).seq == 4
    assert isinstance(decode_replay([b"", b"", b"\xff" * 8, b""]), ReplayEnd)
    assert isinstance(decode_replay([b"", b"\xff" * 8, b""]), ReplayEnd)


@pytest.mark.parametrize("frames,reason", [
    ([b"kv", b"\x00" * 8], "frame_count"),
    ([b"kv", b"\x00" * 7, b""], "seq_length"),
    ([b"kv", b"\x00" * 8, b"\xc1"], "msgpack"),
    (live_frames(0, [stored_map([1], None, [1, 2, 3], 2)]), "token_ids"),
    (live_frames(0, [stored_map([b"short"], None, [1, 2], 2)]), "block_hash"),
    (live_frames(0, [stored_map([1], None, [-1, 2], 2)]), "token_ids"),
    (live_frames(0, [stored_map([True], None, [1, 2], 2)]), "block_hash"),
    (live_frames(0, [42]), "event_shape"),
])
def test_malformed_frames_raise_decode_error_with_reason(frames, reason):
    with pytest.raises(DecodeError) as info:
        decode_live(frames)
    assert info.value.reason == reason


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_arbitrary_frames_only_raise_decode_error(frames):
    for decode in (decode_live, decode_replay):
        with contextlib.suppress(DecodeError):
            decode(frames)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30,
)
event_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
    optional={k: msgpack_values for k in ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                                           "extra_keys", "lora_name", "medium", "group_idx")},
)


@settings(max_examples=200, deadline=None)
@given(st.lists(event_like | msgpack_values, max_size=4), msgpack_values)
def test_structured_garbage_only_raises_decode_error(events, ts):
    with contextlib.suppress(DecodeError):
        decode_payload(0, msgpack.packb([ts, events, 0], use_bin_type=True))


def test_consecutive_removals_become_one_event_in_order():
    offloaded = dict(removed_map([4]), medium="CPU")
    frames = live_frames(0, [removed_map([1]), removed_array([2]), offloaded, removed_map([3]),
                             stored_map([9], None, [1, 2], 2), removed_map([5]), removed_map([6])])
    first, cpu, third, stored, last = decode_live(frames).events
    assert first == BlockRemoved((1, 2), "GPU", None) and cpu == BlockRemoved((4,), "CPU", None)
    assert third == BlockRemoved((3,), "GPU", None) and isinstance(stored, BlockStored)
    assert last == BlockRemoved((5, 6), "GPU", None)


def test_an_empty_removal_in_a_run_is_refused():
    with pytest.raises(DecodeError) as info:
        decode_live(live_frames(0, [removed_map([1]), removed_map([])]))
    assert info.value.reason == "block_hashes"


def test_a_removal_runs_medium_and_group_are_still_checked():
    with pytest.raises(DecodeError) as info:
        decode_live(live_frames(0, [removed_map([1]), dict(removed_map([2]), group_idx="zero")]))
    assert info.value.reason == "field_type"
