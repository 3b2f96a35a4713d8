"""The production gateway under engine faults, on two simulated engines behind a round-robin router:
circuit breaker transitions, failover before the first byte, a mid-stream death, graceful shutdown."""

import json
import os
import signal
import socket
import time

import openai
import pytest
from gateway_http import MODEL, Http, chat
from gateway_production_helpers import (
    SUCCESSES,
    breaker_state,
    engine_counter,
    engine_id,
    served_by,
    set_fault,
    wait_until,
)

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = pytest.mark.integration
FIRST_BYTE_TIMEOUT_S = 1.0
CLOSED, HALF_OPEN, OPEN = 0, 1, 2


@pytest.fixture(scope="module")
def fleet():
    with SimFleetProcess(engines=2, profile="fast", time_scale=0.2) as sims:
        yield sims


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    """Round robin makes every engine the first choice of every other request, faulty or not."""
    path = tmp_path_factory.mktemp("faults") / "router.toml"
    path.write_text(f'policy = "round_robin"\nfirst_byte_timeout_s = {FIRST_BYTE_TIMEOUT_S}\n')
    return str(path)


@pytest.fixture(scope="module")
def router(fleet, config):
    with RouterProcess(fleet.urls, config=config, metrics_interval=0.2) as proc:
        yield proc.await_all_routable()


@pytest.fixture(scope="module")
def client(router) -> Http:
    return Http(router.url)


def ok_from(client: Http, text: str, **extra) -> str:
    """Send one request that must succeed; returns the engine that served it."""
    status, head, data = client.request("POST", "/v1/chat/completions", chat(text, **extra))
    assert status == 200, data
    return served_by(head["x-kvmesh-route"])


def test_failing_engine_opens_its_breaker_then_half_opens_and_closes(client, router, fleet):
    bad, good = fleet.urls
    bad_id = engine_id(bad)
    set_fault(bad, fail_5xx=True)
    try:
        served = [ok_from(client, f"breaker {i}") for i in range(12)]
        assert set(served) == {engine_id(good)}, "a 5xx reached the client or the failing engine served"
        # Open for 1 s, then a failed probe re-opens it for 2 s, 4 s...: traffic keeps it mostly open.
        assert wait_until(lambda: ok_from(client, "open?") == engine_id(good)
                          and breaker_state(router.url, bad_id) == OPEN, 10)
        successes_while_open = engine_counter(bad, SUCCESSES)
        served = [ok_from(client, f"while open {i}") for i in range(4)]
        assert set(served) == {engine_id(good)}
    finally:
        set_fault(bad, clear=True)
    assert engine_counter(bad, SUCCESSES) == successes_while_open
    # No traffic: the open period (1 s, doubled per re-open) runs out and the breaker admits a probe.
    assert wait_until(lambda: breaker_state(router.url, bad_id) == HALF_OPEN, 20, step=0.2)
    assert wait_until(lambda: ok_from(client, "probe") == bad_id, 10), "traffic never returned"
    assert breaker_state(router.url, bad_id) == CLOSED
    assert engine_counter(bad, SUCCESSES) > successes_while_open


def test_stall_before_first_byte_fails_over(client, fleet):
    """The stalled engine gets one of two consecutive streamed requests first; both come back from the
    other one. (A non-streamed request is not sent elsewhere: its engine may still be generating.)"""
    stalled, other = fleet.urls
    set_fault(stalled, stall=FIRST_BYTE_TIMEOUT_S * 5)
    heads = []
    for i in range(2):
        status, head, data = client.request("POST", "/v1/chat/completions", chat(f"stall {i}", stream=True))
        assert status == 200, data
        heads.append(head["x-kvmesh-route"])
    assert [served_by(h) for h in heads] == [engine_id(other)] * 2
    assert any(f"engine={engine_id(stalled)}" in h and "attempts=2" in h for h in heads), heads


def start_stream(router: RouterProcess, content: str, max_tokens: int) -> tuple[socket.socket, bytes]:
    """A streamed chat on a raw connection, read up to its first bytes (a 200 head)."""
    http = Http(router.url)
    conn = socket.create_connection((http.host, http.port), timeout=30)
    body = json.dumps(chat(content, max_tokens=max_tokens, stream=True)).encode()
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = conn.recv(65536)
    assert received.startswith(b"HTTP/1.1 200")
    return conn, received


def test_sigterm_lets_the_stream_finish_and_refuses_new_connections(fleet, config):
    for url in fleet.urls:
        set_fault(url, slow=100)
    router = RouterProcess(fleet.urls, config=config, metrics_interval=0.2).start()
    try:
        http = Http(router.url)
        conn, received = start_stream(router, "drain me", 60)
        os.kill(router.pid, signal.SIGTERM)

        def refused() -> bool:
            try:
                socket.create_connection((http.host, http.port), timeout=2).close()
            except ConnectionRefusedError:
                return True
            return False

        assert wait_until(refused, 5), "the router still accepts connections after SIGTERM"
        while b"data: [DONE]" not in received:
            chunk = conn.recv(65536)
            assert chunk, f"stream cut before [DONE]: {received[-300:]!r}"
            received += chunk
        conn.close()
        assert b'"error"' not in received
        assert router.proc is not None and router.proc.wait(15) == 0
    finally:
        router.stop()
        for url in fleet.urls:
            set_fault(url, clear=True)


def test_a_stream_outliving_the_shutdown_grace_ends_with_an_sse_error(fleet, tmp_path):
    """shutdown_grace_s bounds how long SIGTERM waits; a stream still running then gets an error event in
    OpenAI's shape (not a bare cut) and the router exits."""
    for url in fleet.urls:
        set_fault(url, slow=100)
    config = tmp_path / "router.toml"
    config.write_text('policy = "round_robin"\nshutdown_grace_s = 1.0\n')
    router = RouterProcess(fleet.urls, config=str(config), metrics_interval=0.2).start()
    try:
        conn, received = start_stream(router, "outlive the grace", 5000)
        sigterm_at = time.monotonic()
        os.kill(router.pid, signal.SIGTERM)
        while chunk := conn.recv(65536):
            received += chunk
        conn.close()
        assert b"data: [DONE]" not in received
        last = received.rstrip().rsplit(b"data: ", 1)[-1]
        error = json.loads(last.split(b"\r\n")[0])["error"]
        assert error["code"] == 503 and "shut down" in error["message"], error
        assert router.proc is not None and router.proc.wait(15) == 0
        assert time.monotonic() - sigterm_at < 10
    finally:
        router.stop()
        for url in fleet.urls:
            set_fault(url, clear=True)


def test_engine_death_mid_stream_that_cannot_be_continued_is_an_error_event_the_openai_client_raises(router, fleet):
    """Last in this module: the engine that serves the stream dies for good. With logprobs the stream
    cannot be continued elsewhere (test_gateway_midstream_openai has those that can)."""
    for url in fleet.urls:
        set_fault(url, slow=100)
    api = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "die mid stream"}], max_tokens=300, stream=True,
        logprobs=True)
    victim = served_by(raw.headers["x-kvmesh-route"])
    stream = iter(raw.parse())
    next(stream)
    set_fault(next(u for u in fleet.urls if engine_id(u) == victim), die=True)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for _ in stream:
            assert time.monotonic() - started < 25, "the stream went on after the engine died"
    for url in fleet.urls:
        if engine_id(url) != victim:
            set_fault(url, clear=True)
