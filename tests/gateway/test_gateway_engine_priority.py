"""Priority classes reach the engine as vLLM's ``priority`` only when the map is on; the router's value wins."""

from __future__ import annotations

import json

import pytest
from router_inprocess import MODEL, StubUpstream, call, make_router

from gateway.config import ConfigError
from gateway.engine_priority import EnginePriorityConfig

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def forwarded(config: EnginePriorityConfig, priority: str | None, body: dict) -> tuple[bytes, dict]:
    upstream = StubUpstream()
    router = make_router(upstream, engine_priority=config)
    headers = {"content-type": "application/json", **({"x-priority": priority} if priority else {})}
    raw = json.dumps(body).encode()
    answer = await call(router, "POST", "/v1/chat/completions", raw, headers)
    assert answer.status == 200, answer.body
    sent = upstream.calls[0].body
    return sent, json.loads(sent)


async def test_off_by_default_the_clients_bytes_go_through_unchanged():
    raw, body = await forwarded(EnginePriorityConfig(), "high", {**BODY, "priority": 5})
    assert raw == json.dumps({**BODY, "priority": 5}).encode() and body["priority"] == 5


@pytest.mark.parametrize(("header", "expected"), [("high", -10), ("low", 10), (None, 0)])
async def test_each_class_maps_to_its_engine_priority(header, expected):
    _, body = await forwarded(EnginePriorityConfig(enabled=True), header, BODY)
    assert body["priority"] == expected and body["messages"] == BODY["messages"]


async def test_the_routers_value_replaces_the_clients_own():
    _, body = await forwarded(EnginePriorityConfig(enabled=True, values={"low": 99}), "low", {**BODY, "priority": -50})
    assert body["priority"] == 99


def test_the_map_is_checked():
    with pytest.raises(ConfigError, match="engine_priority.values.urgent"):
        EnginePriorityConfig(enabled=True, values={"urgent": 1}).validate("engine_priority")
    with pytest.raises(ConfigError, match="64-bit"):
        EnginePriorityConfig(values={"high": 2**63}).validate("engine_priority")
