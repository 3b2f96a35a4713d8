"""Through a router to simulated engines: a CPU-tier hit is seen and priced, an adapter's blocks match its
next request (and only its own)."""

import time

import pytest
from gateway_http import Http, chat

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = pytest.mark.integration
ADAPTER = "sql-adapter"


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def document(tag: str, words: int = 300, **extra) -> dict:
    return chat(" ".join(f"{tag}-{i % 37}" for i in range(words)) + " end of document", **extra)


def row(client: Http, body: dict, engine: str) -> dict:
    table = client.json("POST", "/debug/route", body)[2]
    return next(c for c in table["candidates"] if c["engine"] == engine)


TIERED = "tiered-model"
"""The tiered engine serves a model of its own, so one router can hold both engines apart."""


@pytest.fixture(scope="module")
def routed():
    with (SimFleetProcess(engines=1, profile="fast", num_blocks=160, cpu_blocks=1000, model=TIERED) as tiered,
          SimFleetProcess(engines=1, profile="fast", lora_modules=f"{ADAPTER}=/adapters/sql") as lora,
          RouterProcess([tiered.urls[0], lora.urls[0]], metrics_interval=0.2) as proc):
        yield Http(proc.url), tiered.urls[0].removeprefix("http://"), lora.urls[0].removeprefix("http://")


def test_blocks_evicted_to_the_cpu_tier_are_routed_on_and_priced_as_their_load(routed):
    client, engine, _ = routed
    first = document("first", model=TIERED)
    client.json("POST", "/v1/chat/completions", first)
    assert wait_for(lambda: row(client, first, engine)["overlap_exact_tokens"] >= 600)
    for tag in ("second", "third", "fourth"):
        client.json("POST", "/v1/chat/completions", document(tag, model=TIERED))
    found = wait_for(lambda: (r := row(client, first, engine))["overlap_exact_tokens"] < 600 and r)
    runs = found["matched_runs"]
    assert runs and runs[-1]["medium"] == "CPU" and found["load_ms"] > 0, found
    answer = client.json("POST", "/v1/chat/completions", first)[2]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 600, "the engine loaded them"


def test_an_adapters_requests_go_where_it_is_served_and_hit_its_own_blocks(routed):
    client, _, engine = routed
    body = document("adapter", model=ADAPTER)
    status, headers, _ = client.json("POST", "/v1/chat/completions", body)
    assert status == 200 and f"engine={engine}" in headers["x-kvmesh-route"]
    assert wait_for(lambda: row(client, body, engine)["overlap_exact_tokens"] >= 600)
    status, headers, answer = client.json("POST", "/v1/chat/completions", body)
    assert f"engine={engine}" in headers["x-kvmesh-route"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 600
    assert row(client, document("adapter"), engine)["overlap_exact_tokens"] == 0, \
        "the base model never reads the adapter's blocks"
