"""What a continued stream leaves behind: every engine's share of ``in_flight`` and its connection are given
back (the client leaving included), a broken or drained stream is closed when the next one starts, tokens
are counted as tokens, a request that kills engines reaches no third, and an engine's undecodable text ends
the stream with an SSE error (in-process, simulated engines on loopback)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from proxy_harness import Sink, engine_state, failures, sim_engines, start_server
from test_gateway_midstream import CHAT, events, exchange

from gateway.failover import QUERY_OF_DEATH_LOSSES
from gateway.proxy import ProxyResult, forward
from sim.http_server import HttpRequest, HttpResponse
from sim.openai_api import DONE

pytestmark = pytest.mark.integration


def record_responses(state) -> list[Any]:
    """Every response the engine's (real) pool hands out, to check afterwards that each was closed."""
    opened: list[Any] = []
    request = state.pool.request

    async def recording(*args, **kwargs):
        response = await request(*args, **kwargs)
        opened.append(response)
        return response

    state.pool.request = recording
    return opened


async def never_a_first_token(request: HttpRequest) -> HttpResponse:
    """An engine that takes the continuation, sends its response head and then nothing."""
    if request.path == "/tokenize":
        return HttpResponse(200, b'{"count": 10}')

    async def nothing():
        await trio.sleep_forever()
        yield b""

    return HttpResponse(200, content_type="text/event-stream", stream=nothing())


async def test_a_client_leaving_while_a_continuation_opens_gives_back_its_engine_and_connection(nursery):
    sims, states = await sim_engines(nursery, 1)
    sims[0].faults.die_after = 10
    server = await start_server(nursery, never_a_first_token)
    states.append(engine_state(server.url))
    opened = record_responses(states[1])
    async with trio.open_nursery() as client:
        client.start_soon(forward, states, exchange(Sink(), CHAT, prompt_tokens=9), 2)
        with trio.fail_after(10):
            while not any(r.status == 200 for r in opened) or states[1].in_flight == 0:
                await trio.sleep(0.01)
        client.cancel_scope.cancel()  # the client disconnected
    assert [s.in_flight for s in states] == [0, 0]
    assert opened and all(r._connection is None for r in opened), "the continuation's connection was left open"


class ClientAt(Sink):
    """A client that runs ``hooks[n]`` once it has received ``n`` content chunks."""

    def __init__(self, hooks: dict[int, Callable[[], Awaitable[None]]]) -> None:
        super().__init__()
        self.hooks, self.chunks = hooks, 0

    async def send(self, message: dict[str, Any]) -> None:
        await super().send(message)
        before = self.chunks
        self.chunks += message.get("body", b"").count(b'"content":"')
        for after, hook in self.hooks.items():
            if before < after <= self.chunks:
                await hook()


async def test_a_drained_stream_is_closed_and_its_share_given_back_when_the_continuation_starts(nursery):
    sims, states = await sim_engines(nursery, 2)
    seen: list[bool] = []

    async def drain() -> None:
        states[0].draining = True
        states[0].pool.drain_at = trio.current_time()
        sims[0].faults.slow = 200.0  # it would still be generating long after the answer is complete

    async def during_the_continuation() -> None:
        with trio.move_on_after(5):
            while states[0].in_flight or sims[0].inflight:
                await trio.sleep(0.01)
        seen.append(states[0].in_flight == 0 and sims[0].inflight == 0)

    sink = ClientAt({20: drain, 40: during_the_continuation})
    result = await forward(states, exchange(sink, CHAT, prompt_tokens=9), max_attempts=2)
    assert result.continuations[0].reason == "drained"
    assert seen == [True], "the drained engine kept generating and counting the stream"
    assert [s.in_flight for s in states] == [0, 0]


async def test_tokens_are_counted_not_events_when_an_event_carries_several(nursery):
    """vLLM's stream interval (or speculative decoding) puts several tokens in one event: the next engine's
    budget and the usage count the tokens the client got, by the engine's own tokenizer."""
    sims, states = await sim_engines(nursery, 2, stream_interval=4)
    sims[0].faults.error_after = 20  # 20 tokens in 6 events (the first token goes out alone), then an error
    sink = Sink()
    result = await forward(states, exchange(sink, CHAT, prompt_tokens=9), max_attempts=2)
    chunks = [c for c in events(sink) if c["choices"] and c["choices"][0]["delta"].get("content")]
    first_leg = "".join(c["choices"][0]["delta"]["content"] for c in chunks[:6])
    counted = max(6, len(sims[0].tok.tok.encode(first_leg, add_special_tokens=False)))
    assert counted > 6
    [continued] = result.continuations
    assert continued.sent_tokens == counted, "one token per event"
    [usage] = [c["usage"] for c in events(sink) if c.get("usage")]
    assert usage["completion_tokens"] == CHAT["max_tokens"] and usage["prompt_tokens"] == 9
    assert sims[1].success == {"length": 1}


async def test_a_count_past_the_budget_leaves_the_next_engine_one_token_and_usage_at_max_tokens(nursery):
    """Re-tokenizing the text sent can count more tokens than were generated: a count at or past max_tokens
    ended the answer early with usage over max_tokens (the chaos load's streams then failed its usage check)."""
    sims, states = await sim_engines(nursery, 2, stream_interval=4)
    body = {**CHAT, "max_tokens": 10}
    sims[0].faults.error_after = 9  # 9 tokens in 3 events (the first goes out alone), then an error
    sink = Sink()
    result = await forward(states, exchange(sink, body, prompt_tokens=9), max_attempts=2)
    chunks = [c for c in events(sink) if c["choices"] and c["choices"][0]["delta"].get("content")]
    first_leg = "".join(c["choices"][0]["delta"]["content"] for c in chunks[:3])
    assert len(sims[0].tok.tok.encode(first_leg, add_special_tokens=False)) >= 10  # the over-count happens
    [continued] = result.continuations
    assert continued.sent_tokens == 9
    [usage] = [c["usage"] for c in events(sink) if c.get("usage")]
    assert usage["completion_tokens"] == 10 and sims[1].success == {"length": 1}


async def test_a_request_two_engines_died_on_is_not_sent_to_a_third_engine(nursery):
    sims, states = await sim_engines(nursery, 3)
    for sim in sims:
        sim.faults.die_after = 5
    sink = Sink()
    result = await forward(states, exchange(sink, CHAT, prompt_tokens=9), max_attempts=3)
    assert len(result.continuations) == QUERY_OF_DEATH_LOSSES - 1
    last = json.loads(sink.body.split(b"\n\n")[-2][6:])
    assert "died while generating this request" in last["error"]["message"]
    assert failures(states[2]) == 0 and states[2].in_flight == 0
    alive = Sink()  # the third engine never saw the request: it is alive and serves the next one
    sims[2].faults.die_after = 0
    await forward([states[2]], exchange(alive, {**CHAT, "max_tokens": 3}, prompt_tokens=9), max_attempts=1)
    assert alive.body.endswith(b"data: [DONE]\n\n") and sims[2].success == {"length": 1}


async def an_invalid_escape_then_nothing(request: HttpRequest) -> HttpResponse:
    async def broken():
        yield (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"kvmesh-tiny","choices":'
               b'[{"index":0,"text":"a \\q b","logprobs":null,"finish_reason":null}]}\n\n')

    return HttpResponse(200, content_type="text/event-stream", stream=broken())


async def test_an_invalid_json_escape_in_the_first_engines_text_ends_the_stream_with_an_sse_error(nursery):
    server = await start_server(nursery, an_invalid_escape_then_nothing)
    sims, states = await sim_engines(nursery, 1)
    body = {"model": "kvmesh-tiny", "prompt": "once", "max_tokens": 20, "stream": True}
    sink = Sink()
    result: ProxyResult = await forward([engine_state(server.url), *states],
                                        exchange(sink, body, "completion", 3), max_attempts=2)
    last = json.loads(sink.body.split(b"\n\n")[-2][6:])
    assert "not valid JSON" in last["error"]["message"] and not result.continuations
    assert sink.body.count(DONE) == 0 and sims[0].success == {}
