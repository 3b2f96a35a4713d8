"""One test per row of docs/vllm.md's field table that no other test pins: what ingest does with each field of
vLLM 0.32's KV events (indexed, keyed, skipped or ignored)."""

from __future__ import annotations

import sys
from pathlib import Path

from events.decode import decode_payload
from index.block_hash import chain, root_seed
from index.ingest import EngineIngest
from index.prefix_index import PrefixIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "events"))
from events_frames import payload, stored_map  # noqa: E402

MODEL = "tiny"
TOKENS = list(range(8))


def ingested(*events: dict) -> tuple[PrefixIndex, EngineIngest]:
    store = PrefixIndex()
    ingest = EngineIngest("e", MODEL, store)
    ingest.apply(decode_payload(0, payload(list(events))))
    return store, ingest


def held(store: PrefixIndex, lora: str | None = None, salt: str | None = None) -> int:
    return store.overlap(chain(TOKENS, 4, root_seed(MODEL, lora, salt))).get("e", 0)


def test_newer_and_descriptive_fields_change_no_key():
    extra = {"lora_id": 7, "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None,
             "locality": "local", "ownership": "tier-0", "session_id": "s1", "lookahead_token_ids": [9, 9]}
    store, _ = ingested(dict(stored_map([1, 2], None, TOKENS, 4), **extra))
    assert held(store) == 2


def test_lora_name_and_its_extra_key_seed_the_chain_lora_id_alone_does_not():
    store, _ = ingested(stored_map([1, 2], None, TOKENS, 4, lora_name="ad", extra_keys=[["ad"], ["ad"]]))
    assert (held(store, lora="ad"), held(store)) == (2, 0)
    by_id, _ = ingested(dict(stored_map([1, 2], None, TOKENS, 4), lora_id=3))
    assert held(by_id) == 2, "lora_id is deprecated upstream: the name is what keys a block"


def test_bare_salt_in_block_zeros_extra_keys_seeds_the_chain():
    store, _ = ingested(stored_map([1, 2], None, TOKENS, 4, extra_keys=[["tenant"], None]))
    assert (held(store, salt="tenant"), held(store)) == (2, 0)


def test_multimodal_pairs_key_their_block_apart():
    store, _ = ingested(stored_map([1, 2], None, TOKENS, 4, extra_keys=[None, [["img", 0]]]))
    assert held(store) == 1, "block 1 holds an image: a text-only chain stops before it"


def test_blocks_of_other_kv_cache_groups_are_skipped():
    store, ingest = ingested(dict(stored_map([1, 2], None, TOKENS, 4), group_idx=1))
    assert held(store) == 0 and ingest.store.block_count("e") == 0


def test_a_batchs_timestamp_and_rank_are_read_not_keyed():
    batch = decode_payload(3, payload([stored_map([1], None, TOKENS[:4], 4)], ts=12.5, rank=2))
    assert (batch.seq, batch.ts, batch.data_parallel_rank) == (3, 12.5, 2)
