"""LoRA adapters on the simulated engine: vLLM's key layout in hashes and events, and the router reading both."""

import json
import random

from events.decode import decode_payload
from events.discovery import parse_models
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
    assert parse_models(body).adapters == {"sql": "base"}
    orphan = json.dumps({"data": [{"id": "x", "parent": "gone"}, {"id": "y", "parent": "y"}, "junk"]})
    assert parse_models(orphan).adapters == {} and parse_models(b'{"data": null}').adapters == {}


def test_slots_batch_at_most_max_loras_adapters_and_a_load_is_charged_once():
    core = EngineCore(KVCache(64, 4), get_profile("fast"), 8, list(range(10, 20)), "seed", max_loras=1,
                      lora_load_s=1.0)
    other = Adapter("chat", "/adapters/chat", 2)
    for rid, lora in (("a", ADAPTER), ("b", other), ("c", ADAPTER)):
        core.add(SimRequest(rid, PROMPT, 3, "length", random.Random(0), lora=lora))
    first = core.step()
    assert [r.request_id for r in core.running] == ["a", "c"], "chat waits: sql holds the only slot"
    assert [r.request_id for r in core.waiting] == ["b"] and 1.0 <= first.duration < 1.1
    assert core.running_adapters() == {"sql"}
    durations = []
    while core.has_work():
        durations.append(core.step().duration)
    assert sum(d >= 1.0 for d in durations) == 1, "chat is loaded once, when sql's requests are done"


def test_metrics_report_slots_and_running_adapters_as_vllm_does():
    from events.metrics_poller import parse_vllm_metrics
    from sim.metrics import EngineMetrics, Snapshot

    snapshot = Snapshot(1, 0, 0.1, 0, 0, 0, 0, 0, {}, lora={"max_lora": "2", "waiting_lora_adapters": "",
                                                            "running_lora_adapters": "sql"})
    text = EngineMetrics("base", {"block_size": "4"}, lambda: snapshot).render().decode()
    load = parse_vllm_metrics(text)
    assert (load.max_lora, load.running_adapters) == (2, frozenset({"sql"}))


def test_an_adapters_null_context_length_leaves_the_bases():
    body = models_body("base", "/models/base", 4096, 0, [("sql", "/adapters/sql")])
    data = json.loads(body)
    data["data"][1]["max_model_len"] = None  # what vLLM 0.32 lists for an adapter
    listed = parse_models(json.dumps(data))
    assert (listed.ids, listed.max_model_len) == ({"base", "sql"}, 4096)
