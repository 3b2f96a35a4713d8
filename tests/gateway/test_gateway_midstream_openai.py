"""The official openai client reads streams whose engine is killed, stalled or fails mid-answer through a
router process: it gets one complete answer and no exception."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from gateway_http import MODEL

from chaos.invariants import route_engine
from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "write a long answer"}]


@pytest.fixture
def engines():
    """Three engines, one process each, so one can be killed with SIGKILL."""
    fleets = [SimFleetProcess(engines=1, profile="fast", time_scale=1.0) for _ in range(3)]
    try:
        for fleet in fleets:
            fleet.start()
        yield fleets
    finally:
        for fleet in fleets:
            fleet.stop()


@pytest.fixture
def router(engines):
    with RouterProcess([f.urls[0] for f in engines], policy="round_robin", metrics_interval=0.2,
                       env={"KVMESH_IDLE_TIMEOUT_S": "1.0"}) as proc:
        yield proc.await_all_routable()


def api(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def serving(engines, headers) -> SimFleetProcess:
    engine = route_engine(headers.get("x-kvmesh-route", ""))
    return next(f for f in engines if f.urls[0].endswith(engine))


def fault(fleet: SimFleetProcess, body: dict) -> None:
    request = urllib.request.Request(fleet.urls[0] + "/sim/fault", json.dumps(body).encode(), method="POST")
    urllib.request.urlopen(request, timeout=5).read()


def read_whole(client: openai.OpenAI, on_chunk=lambda i, headers: None, max_tokens: int = 300):
    """Stream one chat answer; ``on_chunk(i, headers)`` runs after the i-th content chunk."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    finish, usage, text, ids, i = [], None, [], set(), 0
    for chunk in raw.parse():
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
                i += 1
                on_chunk(i, raw.headers)
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return finish, usage, "".join(text), ids


def continuations(router) -> float:
    with urllib.request.urlopen(router.url + "/metrics", timeout=5) as response:
        metrics = response.read().decode()
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith('kvmesh_stream_continuations_total{outcome="continued"}'))


def test_every_stream_survives_sigkill_of_its_engine_after_20_chunks(engines, router):
    client = api(router)
    killed = threading.Event()

    def kill_at_20(i: int, headers) -> None:
        if i == 20 and not killed.is_set():
            killed.set()
            serving(engines, headers).proc.kill()

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda k: read_whole(client, kill_at_20 if k == 0 else lambda i, h: None),
                                range(6)))
    assert killed.is_set()
    for finish, usage, text, ids in answers:
        assert finish == ["length"] and usage.completion_tokens == 300 and len(ids) == 1 and text
        assert usage.prompt_tokens == answers[0][1].prompt_tokens
    assert continuations(router) >= 1


def test_a_stream_stalled_after_20_chunks_is_finished_by_another_engine(engines, router):
    """Every engine hangs for 30 s once a request of its own reaches 20 tokens: the first engine's hang ends the
    stream there and the continuation, 10 tokens long, never reaches the fault on the engine it goes to."""
    for fleet in engines:
        fault(fleet, {"stall_after": 20, "stall_for": 30})
    finish, usage, _, _ = read_whole(api(router), max_tokens=30)
    assert finish == ["length"] and usage.completion_tokens == 30
    assert continuations(router) == 1
    [line] = [json.loads(x) for x in router.stderr().splitlines() if '"msg": "continued"' in x]
    assert line["continued_from"] != line["continued_to"] and line["sent_tokens"][0] >= 20
    assert "served_by=" in line["route"] and line["latency_ms"][0] > 0


def test_an_sse_error_event_after_20_chunks_is_continued(engines, router):
    """Every engine ends its streams with vLLM's SSE error event after 20 tokens: a 30-token answer is finished
    by one continuation (10 tokens, under the fault) wherever it started."""
    for fleet in engines:
        fault(fleet, {"error_after": 20})
    finish, usage, _, _ = read_whole(api(router), max_tokens=30)
    assert finish == ["length"] and usage.completion_tokens == 30
    assert continuations(router) == 1


def admin(router, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(router.url + path, json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_drain_deadline_moves_running_streams_to_other_engines(engines, router):
    client = api(router)
    drained = []

    def drain_at_20(i: int, headers) -> None:
        if i == 20:
            engine = route_engine(headers["x-kvmesh-route"])
            status, row = admin(router, f"/admin/engines/{engine}/drain", {"deadline_s": 0.2})
            assert status == 200 and row["draining"] and row["drain_deadline_in_s"] == 0.2
            drained.append(engine)

    finish, usage, _, _ = read_whole(client, drain_at_20)
    assert finish == ["length"] and usage.completion_tokens == 300
    assert continuations(router) == 1
    with urllib.request.urlopen(router.url + "/admin/engines", timeout=5) as response:
        row = next(r for r in json.loads(response.read())["engines"] if r["id"] == drained[0])
    assert row["in_flight"] == 0 and row["healthy"], "a drained engine is not charged for the move"
    status, error = admin(router, f"/admin/engines/{drained[0]}/drain", {"deadline_s": "soon"})
    assert status == 400 and error["error"]["param"] == "deadline_s"
