"""Bursts through the proxy after idle gaps longer than the engines' keep-alive: every request succeeds
and no engine is charged for the connections the engines closed (in-process with simulated engines on
loopback, and once through a router process)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import trio
from gateway_http import Http, chat
from proxy_harness import Sink, completion, failures, sim_engines

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess
from gateway.proxy import forward

pytestmark = pytest.mark.integration


async def _burst(states, concurrency: int, tag: str) -> list[int]:
    statuses: list[int] = []

    async def one(i: int) -> None:
        sink = Sink()
        order = states if i % 2 else states[::-1]
        body = {"model": "kvmesh-tiny", "prompt": [i, 7, 9], "max_tokens": 2, "user": tag}
        await forward(order, completion(sink, body, stream=i % 4 == 0), max_attempts=2)
        statuses.append(sink.status)

    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(one, i)
    return statuses


@pytest.mark.parametrize(("keep_alive_s", "race_s", "gap_s"), [(0.5, 0.0, 0.8), (5.0, 5.0, 0.0)],
                         ids=["idle-past-keep-alive", "every-reuse-races-the-close"])
async def test_bursts_after_the_engines_closed_idle_connections_all_succeed(nursery, keep_alive_s, race_s, gap_s):
    _, states = await sim_engines(nursery, 2, keep_alive_s=keep_alive_s, keep_alive_race_s=race_s)
    for round_ in range(3):
        for concurrency in (8, 16):
            statuses = await _burst(states, concurrency, f"{round_}-{concurrency}")
            assert statuses == [200] * concurrency
            await trio.sleep(gap_s)
    assert [failures(s) for s in states] == [0, 0]
    assert all(s.health.breaker.state == "closed" for s in states)
    for state in states:
        status, body = await state.pool.get("/health")
        assert status == 200
        assert json.loads((await state.pool.get("/v1/models"))[1])["data"][0]["id"] == "kvmesh-tiny"
        await state.pool.aclose()


def test_a_router_serves_every_burst_after_idle_gaps_and_charges_no_engine():
    """End to end, as first measured: a router process in front of engines that close idle
    connections after 0.5 s; bursts of 16 after gaps of 1.2 s (requests and health polls both meet
    closed connections)."""
    with SimFleetProcess(engines=2, profile="fast", time_scale=0.2, keep_alive=0.5) as fleet, \
            RouterProcess(fleet.urls, policy="round_robin", metrics_interval=0.3) as router:
        client = Http(router.url)
        statuses = []
        for round_ in range(3):
            time.sleep(1.2)
            with ThreadPoolExecutor(16) as pool:
                statuses += pool.map(lambda i, r=round_: client.request(
                    "POST", "/v1/chat/completions", chat(f"burst {r} {i}"), timeout=60)[0], range(16))
        assert statuses == [200] * 48
        metrics = client.request("GET", "/metrics")[2].decode()
        assert "kvmesh_upstream_errors_total{" not in metrics
