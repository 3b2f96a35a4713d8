"""Real vLLM with a LoRA adapter built at test time, next to a shared engine without it: adapter requests go
to the engine serving the adapter and its blocks (keyed with the adapter) are hit on the next turn; requests
carry the router's priority to an engine scheduling by priority (one sequence slot, so the order shows). One
engine start for the whole module."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from tiny_lora import build_tiny_lora
from vllm_router import WAIT_S, HitMeter, RouterClient, engine_id, user, wait_until
from vllm_wire import EventTap, get_text, metric, tokenize_chat, unique_text

from cluster.router_process import RouterProcess
from cluster.vllm_engine import EngineOptions, VllmEngine, vllm_engines
from index.events import BlockStored

pytestmark = pytest.mark.vllm
ADAPTER = "sql"
BLOCK = 32
QUEUED_TOKENS = 40


@pytest.fixture(scope="module")
def lora_engine(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    adapter = build_tiny_lora(vllm_model, tmp_path_factory.mktemp("tiny-lora"))
    flags = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}",
             "--scheduling-policy", "priority", "--max-num-seqs", "1")
    options = EngineOptions(model=vllm_model, log_dir=tmp_path_factory.mktemp("vllm-lora-logs"), extra_args=flags)
    with vllm_engines(1, options, prefix="vllm-lora") as [engine]:
        yield engine


@pytest.fixture(scope="module")
def routed(engines: list[VllmEngine], lora_engine: VllmEngine, vllm_model: Path) -> Iterator[RouterClient]:
    env = {**os.environ, "KVMESH_ENGINE_PRIORITY__ENABLED": "true",
           "KVMESH_ADMISSION__DEBUG_ROUTE_PER_SECOND": "1000", "KVMESH_ADMISSION__DEBUG_ROUTE_BURST": "1000"}
    with RouterProcess([engines[0].url, lora_engine.url], tokenizer=vllm_model / "tokenizer", metrics_interval=0.2,
                       start_timeout=120.0, env=env, policy="kv_aware") as proc:
        yield RouterClient(proc.url)


def test_the_engine_lists_the_adapter_with_its_base_and_reports_its_slots(lora_engine: VllmEngine) -> None:
    models = get_text(lora_engine, "/v1/models")
    assert f'"id":"{ADAPTER}"' in models.replace(" ", "") and '"parent":"kvmesh-tiny"' in models.replace(" ", "")


def test_adapter_requests_go_to_its_engine_and_hit_its_blocks_on_the_next_turn(
    routed: RouterClient, engines: list[VllmEngine], lora_engine: VllmEngine
) -> None:
    meter = HitMeter({engine_id(engines[0]): engines[0], engine_id(lora_engine): lora_engine})
    messages = user(unique_text(120))
    first, first_hits = meter.send(routed, messages, model=ADAPTER)
    assert first.served_by == engine_id(lora_engine) and first_hits == 0
    rows = lambda: routed.debug_route(messages, model=ADAPTER)["candidates"]  # noqa: E731
    wait_until(lambda: any(r["overlap_exact_tokens"] > 0 for r in rows()))
    second, second_hits = meter.send(routed, messages, model=ADAPTER)
    assert second.served_by == engine_id(lora_engine)
    assert second.predicted_overlap > 0 and second_hits >= second.predicted_overlap - 32
    base = {r["engine"]: r["overlap_exact_tokens"] for r in routed.debug_route(messages)["candidates"]}
    assert base.get(engine_id(lora_engine), 0) == 0, "the base model's chain never matches the adapter's blocks"


def _chat(client: RouterClient, priority: str, messages: list[dict[str, Any]], max_tokens: int,
          done: set[str], name: str) -> None:
    """One chat at ``priority``; streamed (a non-streamed answer's head waits for its last token, and a long one
    would meet the router's first-byte timeout on a loaded machine)."""
    body = {"model": ADAPTER, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection(client.host, client.port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"content-type": "application/json", "x-priority": priority})
        response = conn.getresponse()
        response.read()
        assert response.status == 200, (name, response.status)
    finally:
        conn.close()
    done.add(name)


def _prefill_order(tap: EventTap, first_blocks: dict[str, list[int]]) -> list[str]:
    """Names in the order the engine stored their first prompt block: the engine core publishes its events
    itself, so this is the order it scheduled them, whatever its HTTP front end's delivery did."""
    deadline = time.monotonic() + WAIT_S
    while True:
        order = []
        for batch in tap.batches:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    size = event.block_size
                    for name, block in first_blocks.items():
                        if name not in order and event.token_ids[:size] == tuple(block):
                            order.append(name)
        if len(order) == len(first_blocks):
            return order
        assert time.monotonic() < deadline, f"only {order} announced"
        tap.drain(500)


def test_a_high_priority_request_overtakes_a_low_one_queued_before_it(
    routed: RouterClient, lora_engine: VllmEngine, zmq_context: zmq.Context
) -> None:
    """The engine has one sequence slot: while a long answer holds it, a low request queues, then a high one.
    The engine prefills the high one first only if the router's priority reached it. The order is read from the
    engine's KV events, not from when the answers end: a starved front end once delivered both answers' last
    tokens within 2 ms, in the wrong order."""
    tap = EventTap(lora_engine, zmq_context).open()
    try:
        done: set[str] = set()
        threads = [threading.Thread(target=_chat, args=(routed, "low", user(unique_text(20)), 1000, done, "holder"))]
        threads[0].start()
        wait_until(lambda: metric(lora_engine, "vllm:num_requests_running") >= 1)
        first_blocks = {}
        for name, priority in (("low", "low"), ("high", "high")):
            messages = user(unique_text(20))
            first_blocks[name] = tokenize_chat(lora_engine, messages, model=ADAPTER)[:BLOCK]
            waiting = metric(lora_engine, "vllm:num_requests_waiting")
            threads.append(threading.Thread(target=_chat, args=(routed, priority, messages, 2, done, name)))
            threads[-1].start()
            wait_until(lambda w=waiting: metric(lora_engine, "vllm:num_requests_waiting") > w)
        assert "holder" not in done, "the long answer ended before both requests queued: the test proves nothing"
        for thread in threads:
            thread.join(timeout=120)
        assert done == {"holder", "low", "high"}
        assert _prefill_order(tap, first_blocks) == ["high", "low"]
    finally:
        tap.close()
