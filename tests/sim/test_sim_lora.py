"""LoRA adapters on the simulated engine: vLLM's key layout in hashes and events, and the router reading both."""

import json
import random

from events.decode import decode_payload
from events.discovery import parse_adapters
from index.block_hash import chain, root_seed
from index.ingest import EngineIngest
from index.prefix_index import PrefixIndex
from index.vllm_hash import hash_block, none_hash
from sim.engine_core import EngineCore, SimRequest
from sim.event_encoding import encode_batch
from sim.kv_cache import Adapter, BlockStored, KVCache
from sim.openai_api import models_body
from sim.profiles import get_profile

ADAPTER = Adapter("sql", "/adapters/sql", 1)
PROMPT = list(range(1, 10))  # 2 full blocks of 4


def served(salt=None):
    core = EngineCore(KVCache(16, 4), get_profile("fast"), 4, list(range(10, 20)), "seed")
    core.add(SimRequest("r", PROMPT, 1, "length", random.Random(0), cache_salt=salt, lora=ADAPTER))
    events = []
    while core.has_work():
        events += core.step().events
    return events


def test_hashes_follow_vllms_layout_lora_first_then_the_salt():
    stored = [e for e in served(salt="t") if isinstance(e, BlockStored)]
    first = hash_block(none_hash("seed"), PROMPT[:4], (("lora", "sql", "/adapters/sql"), ("cache_salt", "t")))
    second = hash_block(first, PROMPT[4:8], (("lora", "sql", "/adapters/sql"),))
    assert [h for e in stored for h in e.block_hashes] == [first, second]
    assert stored[0].extra_keys == [("sql", "t"), ("sql",)], "events publish the keys untagged"
    assert stored[0].lora == ADAPTER


def test_the_routers_index_keys_adapter_blocks_under_base_and_adapter():
    payload = encode_batch(0.0, served())
    assert b"lora_name" in payload
    store = PrefixIndex()
    EngineIngest("e", "base", store).apply(decode_payload(0, payload))
    assert store.overlap(chain(PROMPT, 4, root_seed("base", "sql"))) == {"e": 2}
    assert store.overlap(chain(PROMPT, 4, root_seed("base"))) == {}


def test_models_list_adapters_with_the_base_as_parent():
    body = models_body("base", "/models/base", 4096, 0, [("sql", "/adapters/sql")])
    cards = json.loads(body)["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [("base", None, "/models/base"),
                                                                   ("sql", "base", "/adapters/sql")]
    assert parse_adapters(body) == {"sql": "base"}
    orphan = json.dumps({"data": [{"id": "x", "parent": "gone"}, {"id": "y", "parent": "y"}, "junk"]})
    assert parse_adapters(orphan) == {} and parse_adapters(b'{"data": null}') == {}
