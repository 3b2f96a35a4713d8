"""kvmesh in front of real vLLM engines: the router's predictions checked against the engines' own counters.

What the router predicts (the ``overlap`` of ``x-kvmesh-route``, the rows of ``/debug/route``) must be what
the engine then takes from its prefix cache (``vllm:prefix_cache_hits_total``); evictions, restarts and
tenant salts must reach the index; a killed engine must cost clients nothing. The numbers a maintainer
needs (hits per policy, rejoin time, start-up time, memory) are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from vllm_router import (
    HitMeter,
    Routed,
    RouterClient,
    engine_id,
    route_fields,
    user,
    wait_until,
    write_tenant_config,
)
from vllm_wire import chat, post_json, unique_text

from cluster.router_process import RouterProcess
from cluster.vllm_engine import SERVED_MODEL_NAME, VllmEngine, shared_memory_of
from gateway.security.keys import generate_key

pytestmark = pytest.mark.vllm

BLOCK = 32
DOCUMENTS = 4
QUESTIONS = ("Summarise it.", "Who wrote this, and why?", "List every number in it.", "Translate line 3.")
MIB = 1024 * 1024


@contextmanager
def router_for(engines: list[VllmEngine], model: Path, **flags: Any) -> Iterator[RouterProcess]:
    """A router over ``engines`` that loads the very tokenizer folder the engines were started with."""
    polling = {"KVMESH_ADMISSION__DEBUG_ROUTE_PER_SECOND": "1000", "KVMESH_ADMISSION__DEBUG_ROUTE_BURST": "1000"}
    with RouterProcess([e.url for e in engines], tokenizer=model / "tokenizer", metrics_interval=0.2,
                       start_timeout=120.0, env={**os.environ, **polling}, **flags) as proc:
        yield proc


@pytest.fixture(scope="module")
def kv_router(engines: list[VllmEngine], vllm_model: Path) -> Iterator[RouterClient]:
    with router_for(engines, vllm_model, policy="kv_aware") as proc:
        yield RouterClient(proc.url)


def expected_hits(routed: Routed) -> int:
    """vLLM always computes the last prompt token, so a fully cached prompt hits one block less."""
    return min(routed.predicted_overlap, (routed.prompt_tokens - 1) // BLOCK * BLOCK)


def reset_prefix_caches(engines: list[VllmEngine]) -> None:
    for engine in engines:
        post_json(engine, "/reset_prefix_cache", {})


def shared_prefix_workload() -> list[list[dict[str, Any]]]:
    """Documents of ~800 tokens, each asked every question in turn (sequential, as one user would)."""
    documents = [unique_text(260) for _ in range(DOCUMENTS)]
    return [user(f"{document}\n\n{question}") for document in documents for question in QUESTIONS]


def run_workload(client: RouterClient, meter: HitMeter, workload: list[list[dict[str, Any]]],
                 indexed: bool) -> list[tuple[Routed, int]]:
    """Send every request; with ``indexed``, a repeat waits until the router's index holds the document
    (events reach the router a moment after the response that caused them)."""
    results = []
    for i, messages in enumerate(workload):
        if indexed and i % len(QUESTIONS):
            wait_until(lambda m=messages: max(client.overlaps(m).values()) > 0)
        results.append(meter.send(client, messages))
    return results


def test_kv_aware_predicts_engine_hits_and_beats_round_robin(
    engines: list[VllmEngine], vllm_model: Path, kv_router: RouterClient
) -> None:
    meter = HitMeter({engine_id(e): e for e in engines})
    workload = shared_prefix_workload()

    reset_prefix_caches(engines)
    kv = run_workload(kv_router, meter, workload, indexed=True)
    reset_prefix_caches(engines)
    with router_for(engines, vllm_model, policy="round_robin") as proc:
        rr = run_workload(RouterClient(proc.url), meter, workload, indexed=False)

    for routed, hits in kv:
        assert routed.routed_prompt_tokens == routed.prompt_tokens
        assert hits == expected_hits(routed), f"predicted {routed.predicted_overlap}, engine hit {hits}"
    for start in range(0, len(kv), len(QUESTIONS)):
        first, *repeats = [routed for routed, _ in kv[start:start + len(QUESTIONS)]]
        assert first.predicted_overlap == 0
        assert all(r.served_by == first.served_by and r.predicted_overlap > 0 for r in repeats)
    kv_hits, rr_hits = sum(h for _, h in kv), sum(h for _, h in rr)
    queried = sum(r.prompt_tokens for r, _ in kv)
    print(f"\nshared-prefix workload ({len(workload)} requests, {queried} prompt tokens): "
          f"engine prefix-cache hits kv_aware {kv_hits} ({kv_hits / queried:.1%}), "
          f"round_robin {rr_hits} ({rr_hits / queried:.1%})")
    assert rr_hits < 0.8 * kv_hits


def test_router_prompt_tokens_equal_the_engines(kv_router: RouterClient) -> None:
    tag = unique_text(3)
    chats = [
        [{"role": "system", "content": f"You are terse. {tag}"},
         {"role": "user", "content": "Name three rivers."}],
        [{"role": "user", "content": f"hi {tag}"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Explain caches, briefly: ünïcödé, 漢字, emoji 🙂."}],
        user(f"{tag} " + "tabs\tand\nnewlines  and   spaces " * 20),
    ]
    for messages in chats:
        routed = kv_router.chat(messages)
        assert routed.routed_prompt_tokens == routed.prompt_tokens
        assert kv_router.debug_route(messages)["prompt_tokens"] == routed.prompt_tokens


def test_evicted_blocks_leave_the_index(tiny_engine: VllmEngine, vllm_model: Path) -> None:
    tiny = engine_id(tiny_engine)
    capacity = tiny_engine.options.num_gpu_blocks
    assert capacity is not None
    with router_for([tiny_engine], vllm_model, policy="kv_aware") as proc:
        client = RouterClient(proc.url)
        meter = HitMeter({tiny: tiny_engine})
        held = user(unique_text(100))
        stored_blocks = client.chat(held).prompt_tokens // BLOCK
        wait_until(lambda: client.overlaps(held)[tiny] > 0)
        # Each prompt takes ~9 of the engine's blocks: a few more evict the held one.
        for _ in range(6):
            other = user(unique_text(100))
            stored_blocks += client.chat(other).prompt_tokens // BLOCK
            wait_until(lambda m=other: client.overlaps(m)[tiny] > 0)
            if client.overlaps(held)[tiny] == 0:
                break
        assert client.overlaps(held)[tiny] == 0, "the held prompt's blocks were never removed from the index"
        assert client.index()[tiny]["blocks"] <= capacity < stored_blocks
        routed, hits = meter.send(client, held)
        assert routed.predicted_overlap == 0
        assert hits == 0, "the engine still had blocks the router had dropped"


def sigkill(engine: VllmEngine) -> None:
    """Kill the engine's whole process group (API server, EngineCore, worker) without warning, then reap it
    and remove the shared-memory segments a killed vLLM leaves behind (hundreds of MB of RAM)."""
    assert engine.process is not None
    segments = shared_memory_of(engine.process.pid)
    os.killpg(engine.process.pid, signal.SIGKILL)
    engine.stop()
    for path in segments:
        path.unlink(missing_ok=True)


class SteadyLoad:
    """A thread sending one request after another through a router, keeping every outcome."""

    def __init__(self, client: RouterClient, prefix: str, limit: int = 500) -> None:
        self.client, self.prefix, self.limit = client, prefix, limit
        self.served: list[Routed] = []
        self.failed: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for i in range(self.limit):
            if self.stop.is_set():
                return
            try:
                self.served.append(self.client.chat(user(f"{self.prefix}\n\nQuestion {i}: what follows?")))
            except (AssertionError, OSError, ValueError, KeyError) as exc:
                self.failed.append(exc)

    def answered(self) -> int:
        return len(self.served) + len(self.failed)

    def __enter__(self) -> SteadyLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def rejoin_after_restart(engine: VllmEngine, client: RouterClient) -> tuple[float, float]:
    """Start ``engine``; once its /health answers 200, send requests through a round-robin router every
    0.1 s until one lands there (no traffic before: the start-up must not compete with it for the core).

    Returns (start-up time, time from the first healthy /health to the send of that request)."""
    started = time.monotonic()
    engine.start()
    deadline = started + engine.options.startup_timeout
    while not engine.check_ready():
        assert time.monotonic() < deadline, f"{engine.name} not healthy after its restart"
        time.sleep(0.05)
    healthy_at = time.monotonic()
    for _ in range(100):
        sent = time.monotonic()
        if client.chat(user(unique_text(20))).served_by == engine_id(engine):
            return healthy_at - started, sent - healthy_at
        time.sleep(0.1)
    raise AssertionError(f"{engine.name} healthy but not routed to for 100 requests")


def test_killed_engine_fails_over_then_rejoins_with_a_reset_index(
    engines: list[VllmEngine], tiny_engine: VllmEngine, vllm_model: Path
) -> None:
    # The tiny engine shares a core with engines[0]: fail over to the other one, so the restart is not slowed.
    pair = [engines[1], tiny_engine]
    tiny = engine_id(tiny_engine)
    with router_for(pair, vllm_model, policy="kv_aware") as kv_proc, \
            router_for(pair, vllm_model, policy="round_robin") as rr_proc:
        kv, rr = RouterClient(kv_proc.url), RouterClient(rr_proc.url)
        document = unique_text(120)
        # Warm the document on the tiny engine only, so that kv_aware keeps choosing it until it dies.
        chat(tiny_engine, user(f"{document}\n\nQuestion -1: what follows?"))
        wait_until(lambda: kv.overlaps(user(document)).get(tiny, 0) > 0)  # absent until discovered
        memory = {e.name: e.rss_bytes() // MIB for e in pair}
        try:
            with SteadyLoad(kv, document) as load:
                wait_until(lambda: len(load.served) >= 3, timeout=60)
                before = kv.index()[tiny]
                killed_at = load.answered()
                sigkill(tiny_engine)
                wait_until(lambda: load.answered() >= killed_at + 10, timeout=120)
            assert not load.failed, f"clients saw failures: {load.failed[:3]}"
            assert any(r.served_by == tiny for r in load.served[:killed_at])
            failovers = sum(1 for r in load.served if "attempts" in r.route)
            startup_s, rejoin_s = rejoin_after_restart(tiny_engine, rr)
        finally:
            if tiny_engine.process is None:
                tiny_engine.start()
                tiny_engine.wait_ready()
        # The new process starts its seq over: the router must notice and drop the old process's blocks.
        wait_until(lambda: kv.index()[tiny]["resets"] > before["resets"])
        # Its breaker may still be open from the kill: a candidate again once it has passed a probe.
        wait_until(lambda: tiny in kv.overlaps(user(document)), timeout=60)
        assert kv.overlaps(user(document))[tiny] == 0
        assert kv.index()[tiny]["blocks"] < before["blocks"]
    print(f"\nkill: {load.answered()} requests, {killed_at} before the SIGKILL, 0 failed, "
          f"{failovers} failed over; restart: healthy after {startup_s:.1f} s, first routed request "
          f"{rejoin_s:.2f} s after /health answered 200; engine RSS MiB {memory}")
    assert rejoin_s <= 2.0


def test_isolated_tenants_never_share_cached_blocks(
    engines: list[VllmEngine], vllm_model: Path, tmp_path: Path
) -> None:
    keys = {"admin": generate_key(), "tenant-a": generate_key(), "tenant-b": generate_key()}
    config = write_tenant_config(tmp_path / "router.toml", keys["admin"],
                                 {"tenant-a": keys["tenant-a"], "tenant-b": keys["tenant-b"]})
    engine = engines[1]
    target = engine_id(engine)
    with router_for([engine], vllm_model, policy="kv_aware", config=config) as proc:
        tenant_a = RouterClient(proc.url, keys["tenant-a"])
        tenant_b = RouterClient(proc.url, keys["tenant-b"])
        meter = HitMeter({target: engine})
        messages = user(unique_text(80))

        first, first_hits = meter.send(tenant_a, messages)
        assert first_hits == 0 and "overlap" not in first.route, "routing details are for admins only"
        second, second_hits = meter.send(tenant_a, messages)
        assert second_hits > 0, "tenant-a did not reuse its own cached blocks"

        other, other_hits = meter.send(tenant_b, messages)
        assert other_hits == 0, "tenant-b reused tenant-a's cached blocks"


def test_a_stream_whose_engine_is_killed_mid_answer_completes_on_the_other(
    engines: list[VllmEngine], tiny_engine: VllmEngine, vllm_model: Path
) -> None:
    """The official openai client reads one whole 300-token answer although the engine streaming it was
    SIGKILLed after 20 chunks: the router continued the answer on the other engine."""
    import openai

    pair = [engines[1], tiny_engine]
    tiny = engine_id(tiny_engine)
    document = unique_text(60)
    chat(tiny_engine, user(f"{document}\n\nQuestion -1: what follows?"))
    finish, usage, chunks = None, None, 0
    with router_for(pair, vllm_model, policy="kv_aware") as proc:
        kv = RouterClient(proc.url)
        wait_until(lambda: kv.overlaps(user(document)).get(tiny, 0) > 0)  # absent until discovered
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=SERVED_MODEL_NAME, messages=user(f"{document}\n\nQuestion 1: what follows?"),
                max_tokens=300, temperature=0.0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            assert route_fields(raw.headers["x-kvmesh-route"])["engine"] == tiny
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    chunks += 1
                    if chunks == 20:
                        sigkill(tiny_engine)
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    usage = chunk.usage
        finally:
            if tiny_engine.process is None:
                tiny_engine.start()
                tiny_engine.wait_ready()
    print(f"\nmid-stream kill: {chunks} content chunks, finish_reason={finish}, usage={usage}")
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 300


KEEP_ALIVE_S = 5.0
"""How long vLLM's server (uvicorn) keeps an idle connection open (docs/vllm.md)."""


def test_bursts_after_idle_gaps_longer_than_the_keep_alive_all_succeed(
    kv_router: RouterClient, engines: list[VllmEngine]
) -> None:
    """Bursts of concurrent chats, each after a pause in which the engines closed every pooled connection:
    every request is answered 200, and both engines stay routable (a connection the engine closed while
    idle is the pool's problem, not the engine's)."""
    statuses: list[int] = []
    with ThreadPoolExecutor(max_workers=12) as pool:
        for burst in range(3):
            if burst:
                time.sleep(KEEP_ALIVE_S + 1.5)
            answers = pool.map(lambda i, b=burst: kv_router.chat(user(f"Burst {b}, question {i}: say hi."),
                                                                 max_tokens=2), range(12))
            statuses += [routed.status for routed in answers]
    assert statuses == [200] * 36
    assert all(engine["healthy"] for engine in kv_router.engines()), kv_router.engines()
