"""Bursts through the proxy after idle gaps longer than the engines' keep-alive: every request succeeds
and no engine is charged for the connections the engines closed (in-process, simulated engines on
loopback)."""

from __future__ import annotations

import json

import pytest
import trio
from proxy_harness import Sink, completion, failures, sim_engines

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
