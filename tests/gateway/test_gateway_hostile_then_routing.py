"""Hostile traffic leaves no mark on routing: after fuzzed bodies, huge prompts and requests the engines
refuse, a router routes a multi-turn workload as well as a fresh router does on a fresh fleet.

Learned TTFT and decode speeds, breakers and the index are what hostile traffic could skew; the engines'
own prefix-cache counters are the judge (not what the router believes it achieved).
"""

from __future__ import annotations

import random
import urllib.request

import pytest
from gateway_http import MODEL, Http
from test_gateway_fuzz_front_door import hostile_request, send

from bench.engine_stats import delta, fleet_hit_rate, parse_counters
from bench.workloads import text
from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = pytest.mark.integration

CONVERSATIONS = 6
TURNS = 4


def counters(urls: list[str]) -> list[dict[str, float]]:
    return [parse_counters(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()) for url in urls]


def multi_turn_hit_rate(client: Http, engine_urls: list[str]) -> float:
    """Six conversations with their own ~400-token system prompt, four turns each, one request at a time;
    the engines' token hit rate over the workload."""
    rng = random.Random("hostile-then-routing")
    histories = [[{"role": "system", "content": text(rng, 400)}] for _ in range(CONVERSATIONS)]
    before = counters(engine_urls)
    for turn in range(TURNS):
        for i, history in enumerate(histories):
            history.append({"role": "user", "content": f"Turn {turn} of chat {i}: " + text(rng, 30)})
            status, _, answer = client.json("POST", "/v1/chat/completions",
                                            {"model": MODEL, "messages": history, "max_tokens": 8})
            assert status == 200, answer
            history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
    after = counters(engine_urls)
    return fleet_hit_rate([delta(b, a) for b, a in zip(before, after, strict=True)])


def hostile_traffic(client: Http, url: str) -> None:
    """Fuzzed bodies, prompts beyond any context and poison requests every engine fails."""
    rng = random.Random(7)
    for _ in range(200):
        path, raw, headers = hostile_request(rng)
        assert send(url, path, raw, headers)[0] < 500
    for _ in range(3):
        status, _, _ = client.request("POST", "/v1/chat/completions",
                                      {"model": MODEL, "messages": [{"role": "user", "content": "x " * 400_000}],
                                       "max_tokens": 4})
        assert 400 <= status < 500
    for _ in range(20):  # a poison request (every engine fails it with a 500): the router refuses it first
        status, _, _ = client.request("POST", "/v1/chat/completions",
                                      {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 4, "top_k": 2**63})
        assert status == 400


def routed_hit_rate(hostile: bool) -> float:
    with (SimFleetProcess(engines=2, profile="fast", time_scale=0.2) as fleet,
          RouterProcess(fleet.urls, policy="kv_aware", metrics_interval=0.2) as router):
        client = Http(router.url)
        if hostile:
            hostile_traffic(client, router.url)
        return multi_turn_hit_rate(client, fleet.urls)


def test_hostile_traffic_then_routing_matches_a_fresh_router():
    fresh = routed_hit_rate(hostile=False)
    after_hostile = routed_hit_rate(hostile=True)
    assert fresh > 0.5, fresh
    assert abs(after_hostile - fresh) <= 0.02, (after_hostile, fresh)
