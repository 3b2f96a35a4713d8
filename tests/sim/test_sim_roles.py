"""The simulated engine's prefill and decode roles: the handoff a prefill answers with, a decode engine's
load (transfer instead of prefill, external prefix-cache hits) and its error finish on an expired lease."""

import hashlib
import json
import random
from array import array

import pytest

from bench.client import HttpClient
from index.media_keys import MediaSpan
from sim.config import EngineConfig, FleetConfig
from sim.engine_core import EngineCore, SimRequest
from sim.fleet import run_fleet
from sim.kv_cache import KVCache
from sim.profiles import get_profile
from sim.roles import RemoteLoad, loadable_tokens, remote_load, transfer_s
from sim.shared_storage import SharedStorage

PROMPT = "the quick brown fox jumps over the lazy dog " * 40
HANDOFF_FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                  "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                  "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode"}


def test_a_decode_step_computes_only_what_it_did_not_load():
    profile = get_profile("a40-qwen1.5b")
    prompt = list(range(1000, 1000 + 4096))
    durations = []
    for external in (0, loadable_tokens(RemoteLoad(4096, False), 4096, 16)):
        core = EngineCore(KVCache(1024, 16), profile, 8, list(range(10, 100)))
        core.add(SimRequest("r", prompt, 1, "length", random.Random(0), external_tokens=external))
        durations.append(core.step().duration)
        assert core.stats.external_hits == external
    computed, loaded = durations
    assert loaded < computed / 10  # 4080 of 4096 tokens loaded: one step with one block to compute
    assert transfer_s(profile, 4080) < computed / 10  # and the pull is far cheaper than the prefill


def test_remote_load_reads_only_a_decode_handoff():
    assert remote_load({"kv_transfer_params": {"do_remote_decode": True}}, 0.0) is None
    assert remote_load({"kv_transfer_params": "x"}, 0.0) is None
    got = remote_load({"kv_transfer_params": {"do_remote_prefill": True, "remote_num_tokens": 64,
                                              "remote_blocks_expiry_time": 10.0}}, 11.0)
    assert got == RemoteLoad(64, True)


@pytest.fixture
async def pair(nursery):
    config = FleetConfig(engines=3, engine=EngineConfig(num_blocks=256), roles=("prefill", "decode", "decode"))
    engines = await nursery.start(run_fleet, config)
    return [e.info.url for e in engines], engines


def chat(**extra):
    return {"model": "kvmesh-tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
            "seed": 7, **extra}


async def post(client, url, body):
    answer = await client.request(url + "/v1/chat/completions", "POST", json.dumps(body).encode())
    return answer.status, answer.body


async def metric(client, url, name):
    text = (await client.request(url + "/metrics")).body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def test_prefill_answers_a_handoff_and_decode_loads_it_as_external_hits(pair):
    (p, d, other), engines = pair
    client = HttpClient()
    status, raw = await post(client, p, chat(max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                                                "do_remote_prefill": False}))
    params = json.loads(raw)["kv_transfer_params"]
    assert status == 200 and set(params) == HANDOFF_FIELDS and params["do_remote_prefill"] is True
    prompt_tokens = params["remote_num_tokens"]
    assert len(params["remote_block_ids"]) == prompt_tokens // 16
    status, raw = await post(client, d, chat(kv_transfer_params=params))
    loaded = (prompt_tokens - 1) // 16 * 16
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded
    assert await metric(client, d, "vllm:external_prefix_cache_hits_total") == loaded
    assert await metric(client, d, "vllm:prefix_cache_hits_total") == 0
    # The decode engine samples the first token again: the answer is the one an aggregated engine gives.
    status, whole = await post(client, other, chat())
    assert json.loads(whole)["choices"][0]["message"] == json.loads(raw)["choices"][0]["message"]


async def test_an_expired_lease_fails_the_load_with_an_error_finish(pair):
    (p, d, _), _ = pair
    client = HttpClient()
    stale = {"do_remote_prefill": True, "remote_num_tokens": 400, "remote_blocks_expiry_time": 1.0}
    status, raw = await post(client, d, chat(kv_transfer_params=stale))
    assert status == 500 and json.loads(raw)["error"]["message"] == "Internal server error"
    status, raw = await post(client, d, chat(kv_transfer_params=stale, stream=True))
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    assert status == 200 and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[1]["error"]["code"] == 500 and raw.endswith(b"data: [DONE]\n\n")
    assert await metric(client, d, "vllm:request_success_total") == 2  # both finished with "error"
    assert await metric(client, d, "vllm:external_prefix_cache_hits_total") == 0


def test_shared_storage_keys_prompts_as_example_connector_does(tmp_path):
    store = SharedStorage(str(tmp_path), 16)
    prompt = list(range(100, 100 + 600))
    assert store.matched_tokens(prompt, ()) == 0  # empty folder: nothing to load
    store.save(prompt, ())
    (folder,) = list(tmp_path.iterdir())
    # the key: md5 of the first (600 - 1) // 16 * 16 = 592 ids as int64 bytes (torch's tensor.numpy())
    assert folder.name == hashlib.md5(array("q", prompt[:592]).tobytes()).hexdigest()
    assert store.matched_tokens(prompt, ()) == (600 - 2) // 16 * 16  # the lookup: align(len - 1)
    assert store.matched_tokens(prompt[:-1] + [7], ()) == 592  # the last token is not in the key
    assert store.matched_tokens(prompt[:400] + [7] * 200, ()) == 0  # a different prompt
    # Media identifiers are part of the key, as vLLM's mm_hashes.
    media = (MediaSpan("img-1", 0, 16),)
    assert store.matched_tokens(prompt, media) == 0
    # When len - 1 is a multiple of the block size, the key stored covers one block more than the key
    # looked up: ExampleConnector misses such a prompt (and so does the sim).
    odd = list(range(5000, 5000 + 16 * 20 + 1))
    store.save(odd, ())
    assert store.matched_tokens(odd, ()) == 0


@pytest.fixture
async def shared(nursery, tmp_path):
    config = FleetConfig(engines=3, engine=EngineConfig(num_blocks=256, kv_shared_path=str(tmp_path)),
                         roles=("prefill", "decode", "decode"))
    engines = await nursery.start(run_fleet, config)
    return [e.info.url for e in engines], tmp_path


async def test_over_a_shared_folder_decode_loads_what_prefill_stored(shared):
    (p, d, cold), folder = shared
    client = HttpClient()
    handoff_ask = {"do_remote_decode": True, "do_remote_prefill": False}
    status, raw = await post(client, cold, chat())  # a cold decode engine (empty folder) still answers
    assert status == 200 and await metric(client, cold, "vllm:external_prefix_cache_hits_total") == 0
    # ...having asked its connector, as vLLM counts every request of an engine with one
    assert await metric(client, cold, "vllm:external_prefix_cache_queries_total") > 0
    reference = json.loads(raw)
    text = "another prompt, the prefill leg's own " * 40
    body = chat(messages=[{"role": "user", "content": text}])
    status, raw = await post(client, p, {**body, "max_tokens": 1, "kv_transfer_params": handoff_ask})
    assert status == 200 and json.loads(raw)["kv_transfer_params"] is None  # the connector hands none over
    prompt_tokens = json.loads(raw)["usage"]["prompt_tokens"]
    assert (prompt_tokens - 1) % 16  # not the one length in 16 where ExampleConnector's keys differ
    status, raw = await post(client, d, body)
    loaded = (prompt_tokens - 2) // 16 * 16
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded
    assert await metric(client, d, "vllm:external_prefix_cache_hits_total") == loaded
    assert await metric(client, d, "vllm:prefix_cache_hits_total") == 0
    # The cold engine's prompt was stored when it computed it: the decode engine loads that one too.
    status, raw = await post(client, d, chat())
    assert json.loads(raw)["choices"][0]["message"] == reference["choices"][0]["message"]
    assert await metric(client, d, "vllm:external_prefix_cache_hits_total") > loaded
    assert len(list(folder.iterdir())) == 2
