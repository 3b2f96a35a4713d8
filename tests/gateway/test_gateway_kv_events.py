"""The router's index follows simulated engines' KV events: flow, gaps filled by replay, restarts, eviction."""

import os
import socket
import time

import pytest
from gateway_http import Http, chat, wait_for

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = pytest.mark.integration


def overlap(client: Http, body: dict, engine: str) -> int:
    table = client.json("POST", "/debug/route", body)[2]
    return next(c["overlap_exact_tokens"] for c in table["candidates"] if c["engine"] == engine)


def document(tag: str, words: int = 300) -> dict:
    return chat(" ".join(f"{tag}-{i % 37}" for i in range(words)) + " end of document")


@pytest.fixture(scope="module")
def small_fleet():
    """One engine with room for about two documents, so a third evicts the first."""
    with SimFleetProcess(engines=1, profile="fast", time_scale=0.2, num_blocks=160) as sims:
        yield sims


@pytest.fixture(scope="module", params=["loop", "process"])
def small(small_fleet, request):
    """A router ingesting on its serving loop, and one ingesting in its ingest process (``ingest_process``)."""
    env = {**os.environ, "KVMESH_INGEST_PROCESS": "true"} if request.param == "process" else None
    with RouterProcess(small_fleet.urls, metrics_interval=0.2, env=env) as proc:
        yield Http(proc.url), small_fleet.urls[0].removeprefix("http://"), Http(small_fleet.urls[0])


def test_events_flow_into_the_index(small, request):
    client, engine, _ = small
    body = document("flow")
    client.json("POST", "/v1/chat/completions", body)
    assert wait_for(lambda: overlap(client, body, engine) >= 600)
    ingest = client.json("GET", "/admin/index")[2]["ingest"]
    in_process = request.node.callspec.params["small"] == "process"
    assert ingest["process"] is in_process
    assert (ingest.get("worker_pid") is not None) is in_process


def test_gap_is_filled_by_replay(small):
    """Batches the engine published while the router heard nothing come back through the replay socket."""
    client, engine, sim = small
    sim.json("POST", "/sim/fault", {"drop_events": True})
    hidden = document("hidden")
    try:
        client.json("POST", "/v1/chat/completions", hidden)
        time.sleep(0.3)
        assert overlap(client, hidden, engine) == 0
    finally:
        sim.json("POST", "/sim/fault", {"clear": True})
    client.json("POST", "/v1/chat/completions", chat("a short request that publishes a new batch " * 5))
    assert wait_for(lambda: overlap(client, hidden, engine) >= 600)
    assert client.json("GET", "/admin/index")[2]["engines"][engine]["gaps"] >= 1


def test_eviction_stops_routing_on_evicted_blocks(small):
    client, engine, _ = small
    first = document("first")
    client.json("POST", "/v1/chat/completions", first)
    assert wait_for(lambda: overlap(client, first, engine) >= 600)
    for tag in ("second", "third", "fourth"):
        client.json("POST", "/v1/chat/completions", document(tag))
    assert wait_for(lambda: overlap(client, first, engine) < 600)


def test_cleared_cache_drops_the_engines_blocks(small):
    client, engine, sim = small
    body = document("cleared")
    client.json("POST", "/v1/chat/completions", body)
    assert wait_for(lambda: overlap(client, body, engine) >= 600)
    sim.json("POST", "/reset_prefix_cache", {})
    client.json("POST", "/v1/chat/completions", chat("after the reset " * 3))
    assert wait_for(lambda: overlap(client, body, engine) == 0)


def test_approximate_knows_only_what_it_sent(small_fleet):
    """The ``approximate`` baseline stands for routers without events: a cleared cache goes unnoticed."""
    with RouterProcess(small_fleet.urls, metrics_interval=0.2, policy="approximate") as proc:
        client, engine = Http(proc.url), small_fleet.urls[0].removeprefix("http://")
        body = document("unseen")
        client.json("POST", "/v1/chat/completions", body)
        Http(small_fleet.urls[0]).json("POST", "/reset_prefix_cache", {})
        time.sleep(0.5)
        table = client.json("POST", "/debug/route", body)[2]
        row = next(c for c in table["candidates"] if c["engine"] == engine)
        assert row["overlap_exact_tokens"] == 0 and row["overlap_approx_tokens"] >= 600
        assert client.json("GET", "/admin/index")[2]["engines"][engine]["has_events"] is False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_restart_resets_its_blocks_and_it_rejoins():
    """A restarted engine (same ports, seq back to 0, cold cache) loses its index entries and serves again."""
    ports = {"base_port": free_port(), "event_base_port": free_port(), "replay_base_port": free_port()}
    first = SimFleetProcess(engines=1, profile="fast", time_scale=0.2, **ports).start()
    try:
        url = first.urls[0]
        engine = url.removeprefix("http://")
        with RouterProcess([url], metrics_interval=0.2) as proc:
            client = Http(proc.url)
            body = document("before-restart")
            for _ in range(3):
                client.json("POST", "/v1/chat/completions", body)
            assert wait_for(lambda: overlap(client, body, engine) >= 600)
            first.stop()
            first = SimFleetProcess(engines=1, profile="fast", time_scale=0.2, **ports).start()
            healthy_at = time.monotonic()
            assert wait_for(lambda: client.json("POST", "/v1/chat/completions", chat("back?"))[0] == 200)
            rejoined = time.monotonic() - healthy_at
            client.json("POST", "/v1/chat/completions", chat("fresh batches after the restart " * 10))
            assert wait_for(lambda: overlap(client, body, engine) == 0)
            assert client.json("GET", "/admin/index")[2]["engines"][engine]["resets"] >= 1
            assert rejoined < 2.0
    finally:
        first.stop()
