"""Multimodal block keys: vLLM 0.32's layout (written out from its algorithm; tests/vllm/test_vllm_media_keys.py runs
vLLM's own code on it), the simulated engine's hashes and events, and the router's own keys."""

import random

import pytest

from events.decode import decode_payload
from index.block_hash import chain, root_seed
from index.ingest import EngineIngest
from index.media_keys import MediaSpan, block_media, media_chain
from index.prefix_index import PrefixIndex
from index.vllm_hash import BlockHasher, hash_block, none_hash, salt_extra_keys
from sim.engine_core import EngineCore, SimRequest
from sim.event_encoding import encode_batch
from sim.kv_cache import BlockStored, KVCache
from sim.profiles import get_profile

BS = 4
PROMPT = list(range(100, 122))  # 5 full blocks of 4 and 2 tokens more
SPANS = (MediaSpan("img-a", 2, 7), MediaSpan("img-b", 9, 3), MediaSpan("aud", 16, 2))
"""img-a covers tokens 2..8 (blocks 0-2), img-b 9..11 (block 2), aud 16..17 (block 4)."""


def test_each_block_lists_the_items_it_overlaps_with_their_start_relative_to_the_block():
    assert [block_media(SPANS, i, BS) for i in range(5)] == [
        (("img-a", 2),),
        (("img-a", -2),),
        (("img-a", -6), ("img-b", 1)),
        (),
        (("aud", 0),),
    ]


def test_an_item_ending_on_a_block_boundary_does_not_key_the_next_block():
    assert block_media((MediaSpan("x", 0, 4),), 1, BS) == ()
    assert block_media((MediaSpan("x", 3, 1),), 0, BS) == (("x", 3),)


def test_hash_keys_are_tagged_lora_then_mm_then_salt_and_events_untagged():
    pairs = (("img", -2), ("aud", 1))
    hasher = BlockHasher(BS, "t", "seed", ("sql", "/a"), (MediaSpan("img", 2, 4), MediaSpan("aud", 5, 2)))
    hasher.extend(PROMPT[:8])
    first = hash_block(none_hash("seed"), PROMPT[:4], (("lora", "sql", "/a"), ("mm", "img", 2), ("cache_salt", "t")))
    second = hash_block(first, PROMPT[4:8], (("lora", "sql", "/a"), ("mm", "img", -2), ("mm", "aud", 1)))
    assert hasher.hashes == [first, second]
    assert salt_extra_keys(1, "t", ("sql", "/a"), pairs) == ("sql", ("img", -2), ("aud", 1))
    assert salt_extra_keys(0, "t", None, (("img", 2),)) == (("img", 2), "t")


def served(spans, salt=None):
    core = EngineCore(KVCache(32, BS), get_profile("fast"), 4, list(range(10, 20)), "seed")
    core.add(SimRequest("r", PROMPT, 1, "length", random.Random(0), cache_salt=salt, media=spans))
    events = []
    while core.has_work():
        events += core.step().events
    return events


def test_the_simulated_engines_events_carry_the_pairs_and_hash_them_tagged():
    stored = [e for e in served(SPANS) if isinstance(e, BlockStored)]
    assert [k for e in stored for k in e.extra_keys] == [
        (("img-a", 2),), (("img-a", -2),), (("img-a", -6), ("img-b", 1)), None, (("aud", 0),)]
    expected = BlockHasher(BS, None, "seed", None, SPANS)
    expected.extend(PROMPT)
    assert [h for e in stored for h in e.block_hashes] == expected.hashes


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_the_routers_predicted_keys_equal_what_ingesting_the_engines_events_gives(salt):
    store = PrefixIndex()
    ingest = EngineIngest("e", "m", store)
    ingest.apply(decode_payload(0, encode_batch(0.0, served(SPANS, salt))))
    seed = root_seed("m", None, salt)
    assert store.overlap(media_chain(PROMPT, BS, seed, SPANS)) == {"e": 5}
    other = (MediaSpan("img-other", 2, 7), *SPANS[1:])
    assert store.overlap(media_chain(PROMPT, BS, seed, other)) == {}, "another image misses from its first block"
    late = (SPANS[0], SPANS[1], MediaSpan("aud-other", 16, 2))
    assert store.overlap(media_chain(PROMPT, BS, seed, late)) == {"e": 4}, "blocks before the item still match"
    assert store.overlap(chain(PROMPT, BS, seed)) == {}, "a text-only chain never reads an image's blocks"


def test_without_media_the_chain_is_the_text_chain():
    assert media_chain(PROMPT, BS, 7, ()) == chain(PROMPT, BS, 7)
