"""The typed fast path for map-form batches gives exactly what the generic path gives (the batch, or the
DecodeError reason) on generated batches: valid and broken fields, omitted defaults, unknown fields and
event types, both hash forms, legacy arrays mixed in, and bytes cut short."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from events.decode import DecodeError, _decode_generic, decode_payload
from index.events import EventBatch

U64 = 2**64 - 1
_odd = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3), st.binary(max_size=3),
                 st.integers(-(2**63), U64), st.lists(st.integers(0, 9), max_size=2),
                 st.dictionaries(st.text(max_size=2), st.integers(0, 9), max_size=1))
_hash = st.one_of(st.integers(0, U64), st.binary(min_size=32, max_size=32))


@st.composite
def _mostly(draw: st.DrawFn, good: st.SearchStrategy, bad: st.SearchStrategy = _odd) -> object:
    """Usually a good value, one time in twenty a bad one: most batches stay well formed and take the
    typed path, the rest exercise its refusals."""
    return draw(bad if draw(_rarely) else good)


_rarely = st.sampled_from([False] * 19 + [True])
_hash_or_odd = _mostly(_hash)
_extra_item = st.one_of(st.none(), st.text(max_size=3), st.integers(0, 9),
                        st.recursive(st.lists(st.integers(0, 9), max_size=2), lambda c: st.lists(c, max_size=2),
                                     max_leaves=6))


@st.composite
def _maybe(draw: st.DrawFn, field: str, value: st.SearchStrategy) -> dict:
    """A field that is present, absent (left at its default), or now and then present with an unexpected
    value (rarely, so most batches are well formed and take the typed path)."""
    return {} if draw(st.booleans()) else {field: draw(_mostly(value))}


@st.composite
def _stored(draw: st.DrawFn) -> dict:
    blocks = draw(st.integers(0, 3))
    size = draw(_mostly(st.sampled_from([1, 2, 16]), st.sampled_from([0, 65537])))
    hashes = draw(st.lists(_hash_or_odd, min_size=blocks, max_size=blocks))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=blocks * max(size, 0) % 64,
                           max_size=blocks * max(size, 0) % 64))
    if draw(_rarely):
        tokens = tokens[1:] or [0]  # a count that does not match the blocks
    if draw(_rarely):
        tokens = draw(st.lists(st.one_of(st.integers(-1, 2**32), st.booleans()), max_size=4))
    event = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens, "block_size": size}
    for field, value in (("parent_block_hash", st.one_of(st.none(), _hash)), ("medium", st.sampled_from(["GPU", None])),
                         ("lora_name", st.sampled_from(["ad", None])), ("lora_id", st.integers(0, 3)),
                         ("group_idx", st.integers(0, 3)), ("kv_cache_spec_kind", st.just("full_attention")),
                         ("extra_keys", st.one_of(st.none(), st.lists(_extra_item, min_size=blocks,
                                                                      max_size=blocks + draw(st.integers(0, 1)))))):
        event |= draw(_maybe(field, value))
    return event


@st.composite
def _removed(draw: st.DrawFn) -> dict:
    event = {"type": "BlockRemoved", "block_hashes": draw(st.lists(_hash_or_odd, max_size=3))}
    for field, value in (("medium", st.sampled_from(["GPU", "CPU", None])), ("group_idx", st.integers(0, 1))):
        event |= draw(_maybe(field, value))
    return event


_typed_event = st.one_of(_stored(), _removed(), st.just({"type": "AllBlocksCleared", "locality": 1}),
                         st.builds(lambda e: e | {"session_id": "s", "lookahead_token_ids": [1]}, _stored()))
_other_event = st.one_of(st.just({"type": "FutureEvent", "x": 1}), st.just({"no_type": 1}), st.just({"type": 3}),
                         st.builds(lambda e: ["BlockRemoved", e["block_hashes"]], _removed()),
                         st.just(["AllBlocksCleared"]), _odd)
_event = _mostly(_typed_event, _other_event)


@st.composite
def _payload(draw: st.DrawFn) -> bytes:
    ts = draw(_mostly(st.one_of(st.floats(0, 2e9), st.integers(0, 2**40))))
    batch: list = [ts, draw(st.lists(_event, max_size=6))]
    batch += draw(st.lists(_mostly(st.one_of(st.none(), st.integers(0, 8))), max_size=2))
    payload = msgpack.packb(batch, use_bin_type=True)
    if draw(_rarely):
        payload = payload[:draw(st.integers(0, len(payload)))]
    return payload


def _outcome(decode, payload: bytes) -> EventBatch | str:
    try:
        return decode(3, payload)
    except DecodeError as exc:
        return exc.reason


@settings(max_examples=600, deadline=None)
@given(_payload())
def test_the_typed_path_decodes_exactly_as_the_generic_path(payload):
    assert _outcome(decode_payload, payload) == _outcome(_decode_generic, payload)


def test_a_well_formed_map_batch_takes_the_typed_path():
    """The fast path is not silently skipped: a vLLM-shaped batch decodes without the generic unpacker."""
    import events.decode as decode_module

    payload = msgpack.packb([1.5, [{"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [5, 6],
                                    "block_size": 1, "medium": "GPU", "extra_keys": [None, None]},
                                   {"type": "BlockRemoved", "block_hashes": [2]},
                                   {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]}], 0])
    generic, decode_module._decode_generic = decode_module._decode_generic, None
    try:
        batch = decode_payload(1, payload)
    finally:
        decode_module._decode_generic = generic
    assert batch == generic(1, payload)
    assert len(batch.events) == 2 and batch.events[1].block_hashes[0] == 2


def test_plain_text_extra_keys_are_matched_whole_and_still_counted():
    """One None per block (what vLLM sends for plain text) is read from the bytes without unpacking, yet a
    count that differs from the blocks is refused as the generic path refuses it, for short and long events."""
    for blocks, nils in ((1, 1), (3, 3), (20, 20), (2, 3), (3, 2), (15, 16)):
        payload = msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": list(range(1, blocks + 1)),
                                        "token_ids": [1] * blocks, "block_size": 1, "extra_keys": [None] * nils}]])
        outcome = _outcome(decode_payload, payload)
        assert outcome == _outcome(_decode_generic, payload)
        assert outcome == "extra_keys" if blocks != nils else outcome.events[0].extra_keys is None
