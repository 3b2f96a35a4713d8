"""Ingesting BlockStored events yields exactly the router's own-key chain for the same tokens."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from events.decode import decode_payload
from index.block_hash import chain, root_seed
from index.ingest import EngineIngest, split_extra_keys
from index.prefix_index import PrefixIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "events"))
from events_frames import payload, removed_array, removed_map, stored_array, stored_map  # noqa: E402

MODEL = "tiny"


@st.composite
def stored_stream(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    blocks = draw(st.integers(1, 12))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=blocks * block_size,
                           max_size=blocks * block_size))
    cuts = sorted(draw(st.sets(st.integers(1, blocks - 1), max_size=4))) if blocks > 1 else []
    salt = draw(st.one_of(st.none(), st.text(min_size=1, max_size=5)))
    lora = draw(st.one_of(st.none(), st.sampled_from(["adapter", "x"])))
    salt_style = draw(st.sampled_from(["plain", "tuple"]))
    as_bytes = draw(st.booleans())
    encoding = draw(st.sampled_from([stored_map, stored_array]))
    return block_size, blocks, tokens, cuts, salt, lora, salt_style, as_bytes, encoding


def engine_hash(i: int, as_bytes: bool):
    value = (i * 0x9E3779B97F4A7C15 + 12345) % 2**64
    return value.to_bytes(32, "big") if as_bytes else value


def block_extras(i: int, salt: str | None, lora: str | None, style: str):
    items: list = []
    if lora is not None:
        items.append(lora if style == "plain" else ["lora", lora, "/path"])
    if i == 0 and salt is not None:
        items.append(salt if style == "plain" else ["cache_salt", salt])
    return items or None


@settings(max_examples=200, deadline=None)
@given(stored_stream())
def test_ingested_keys_equal_router_chain(case):
    block_size, blocks, tokens, cuts, salt, lora, style, as_bytes, encoding = case
    store = PrefixIndex()
    ingest = EngineIngest("e1", MODEL, store)
    bounds = [0, *cuts, blocks]
    for seq, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        event = encoding([engine_hash(i, as_bytes) for i in range(lo, hi)],
                         None if lo == 0 else engine_hash(lo - 1, as_bytes),
                         tokens[lo * block_size : hi * block_size], block_size, lora_name=lora,
                         extra_keys=[block_extras(i, salt, lora, style) for i in range(lo, hi)])
        stats = ingest.apply(decode_payload(seq, payload([event])))
        assert stats.stored == hi - lo and stats.orphaned == 0
    expected = chain(tokens, block_size, root_seed(MODEL, lora, salt))
    assert store.overlap(expected) == {"e1": blocks}
    other_tenant = chain(tokens, block_size, root_seed(MODEL, lora, (salt or "") + "-other"))
    assert store.overlap(other_tenant) == {}


def test_remove_orphans_and_filtered_media():
    store = PrefixIndex()
    ingest = EngineIngest("e1", MODEL, store)
    tokens = list(range(8))
    ingest.apply(decode_payload(0, payload([stored_array([11, 12], None, tokens, 4)])))
    orphan = stored_map([99], 5555, [1, 2, 3, 4], 4)
    offloaded = dict(stored_map([77], None, [1, 2, 3, 4], 4), medium="HBM")  # a medium kvmesh does not know
    stats = ingest.apply(decode_payload(1, payload([orphan, offloaded, removed_array([12])])))
    assert (stats.orphaned, stats.skipped, stats.removed) == (1, 1, 1)
    assert store.overlap(chain(tokens, 4, root_seed(MODEL))) == {"e1": 1}
    stats = ingest.apply(decode_payload(2, payload([["AllBlocksCleared"]])))
    assert stats.cleared == 1 and store.block_count("e1") == 0
    assert ingest.last_seq == 2


def test_one_batch_keeps_event_order_across_merged_stores():
    """Stored events of one batch enter the store together, yet a decode block chained on a block stored
    earlier in the batch gets the router's key, and a removal between them applies in its place."""
    store = PrefixIndex()
    ingest = EngineIngest("e1", MODEL, store)
    tokens = list(range(24))
    events = [stored_map([1, 2], None, tokens[:8], 4), stored_map([3], 2, tokens[8:12], 4),
              stored_array([4], 3, tokens[12:16], 4), removed_map([4]), stored_map([5], 4, tokens[16:20], 4),
              stored_map([6], 3, tokens[20:24], 4)]
    stats = ingest.apply(decode_payload(0, payload(events)))
    assert (stats.stored, stats.removed, stats.orphaned) == (5, 1, 1)
    keys = chain(tokens[:12] + tokens[20:24], 4, root_seed(MODEL))
    assert store.overlap(keys) == {"e1": 4} and stats.stored_keys[:3] == keys[:3]
    assert store.block_count("e1") == 4 and store.own_key("e1", 5) is None


def test_multimodal_extra_keys_never_match_text_chain():
    store = PrefixIndex()
    ingest = EngineIngest("e1", MODEL, store)
    tokens = [5] * 8
    event = stored_map([1, 2], None, tokens, 4, extra_keys=[[["img-hash", 0]], None])
    ingest.apply(decode_payload(0, payload([event])))
    assert store.overlap(chain(tokens, 4, root_seed(MODEL))) == {}


def test_split_extra_keys_reads_both_forms():
    assert split_extra_keys(("adapter", "salt"), "adapter", True).cache_salt == "salt"
    assert split_extra_keys((("cache_salt", "s"),), None, True).cache_salt == "s"
    assert split_extra_keys((("lora", "n", "/p"),), None, False).lora_name == "n"
    assert split_extra_keys(("adapter",), "adapter", False).other is None
    assert split_extra_keys((("mm", 3),), None, False).other is not None
