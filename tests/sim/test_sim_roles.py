"""The simulated engine's prefill and decode roles: the handoff a prefill answers with, a decode engine's
load (transfer instead of prefill, external prefix-cache hits) and its error finish on an expired lease."""

import json
import random

import pytest

from bench.client import HttpClient
from sim.config import EngineConfig, FleetConfig
from sim.engine_core import EngineCore, SimRequest
from sim.fleet import run_fleet
from sim.kv_cache import KVCache
from sim.profiles import get_profile
from sim.roles import RemoteLoad, loadable_tokens, remote_load, transfer_s

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
