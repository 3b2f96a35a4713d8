"""Streams that break after the first token are continued on the next engine and spliced into the
client's stream (in-process, simulated engines on loopback)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import trio
from proxy_harness import Sink, failures, sim_engines

from gateway.continuation import ContinuationSpec
from gateway.engines import EngineState
from gateway.proxy import Exchange, ProxyResult, Timeouts, UpstreamFailure, forward

pytestmark = pytest.mark.integration
MODEL = "kvmesh-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 300,
        "stream": True, "stream_options": {"include_usage": True}}


class CountingSink(Sink):
    """A client that runs ``at_chunk`` once it has received ``after`` content chunks."""

    def __init__(self, after: int = 0, at_chunk: Callable[[], Any] = lambda: None) -> None:
        super().__init__()
        self.after, self.at_chunk, self.chunks = after, at_chunk, 0

    async def send(self, message: dict[str, Any]) -> None:
        await super().send(message)
        before = self.chunks
        self.chunks += message.get("body", b"").count(b'"content":"') + message.get("body", b"").count(b'"text":"')
        if before < self.after <= self.chunks:
            self.at_chunk()


def events(sink: Sink) -> list[dict]:
    out = [json.loads(e[6:]) for e in sink.body.split(b"\n\n") if e.startswith(b"data: {")]
    assert sink.body.endswith(b"data: [DONE]\n\n") and sink.body.count(b"[DONE]") == 1
    return out


def exchange(sink: Sink, body: dict, kind: str = "chat", prompt_tokens: int = 0,
             timeouts: Timeouts | None = None) -> Exchange:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return Exchange("POST", path, json.dumps(body).encode(), [("content-type", "application/json")], sink.send,
                    timeouts or Timeouts(), lambda engine, attempts: [], True,
                    ContinuationSpec.of(body, kind, True, prompt_tokens))


def assert_one_complete_answer(sink: Sink, max_tokens: int, prompt_tokens: int) -> list[dict]:
    chunks = events(sink)
    assert not [c for c in chunks if "error" in c]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and
            c["choices"][0]["finish_reason"]] == ["length"]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == max_tokens
    assert usage[0]["prompt_tokens"] == prompt_tokens
    return chunks


async def three_engines(nursery) -> tuple[list, list[EngineState], int]:
    sims, states = await sim_engines(nursery, 3)
    return sims, states, len(sims[0].tok.prompt_ids(CHAT, "chat"))


async def test_an_engine_that_dies_after_20_tokens_costs_the_client_nothing(nursery):
    sims, states, prompt = await three_engines(nursery)
    sims[0].faults.die_after = 20
    sink = Sink()
    result = await forward(states, exchange(sink, CHAT, prompt_tokens=prompt), max_attempts=3)
    chunks = assert_one_complete_answer(sink, 300, prompt)
    assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
    [continued] = result.continuations
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get(
        "content")]
    counted = max(20, len(sims[0].tok.tok.encode("".join(pieces[:20]), add_special_tokens=False)))
    assert (continued.from_engine, continued.to_engine, continued.sent_tokens) == (states[0].id, states[1].id,
                                                                                    counted)
    assert continued.latency_s is not None and failures(states[0]) == 1
    assert sims[1].success == {"length": 1}


async def test_an_sse_error_event_is_continued_not_forwarded(nursery):
    sims, states, prompt = await three_engines(nursery)
    sims[0].faults.error_after = 20
    sink = Sink()
    result = await forward(states, exchange(sink, CHAT, prompt_tokens=prompt), max_attempts=3)
    assert_one_complete_answer(sink, 300, prompt)
    assert result.continuations[0].reason.startswith("engine error event")


async def test_a_stall_between_tokens_is_continued_after_the_idle_timeout(nursery):
    sims, states, prompt = await three_engines(nursery)

    def stall() -> None:
        sims[0].faults.stall_s = 30.0
        sims[0]._wakeup()

    sink = CountingSink(20, stall)
    result = await forward(states, exchange(sink, CHAT, prompt_tokens=prompt, timeouts=Timeouts(idle=0.5)),
                           max_attempts=3)
    assert_one_complete_answer(sink, 300, prompt)
    assert "stalled" in result.continuations[0].reason


async def test_a_completion_is_continued_from_its_prompt_and_text(nursery):
    sims, states = await sim_engines(nursery, 2)
    body = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}}
    prompt = len(sims[0].tok.prompt_ids(body, "completion"))
    sims[0].faults.die_after = 10
    sink = Sink()
    await forward(states, exchange(sink, body, "completion", prompt), max_attempts=2)
    chunks = assert_one_complete_answer(sink, 40, prompt)
    assert all(c["object"] == "text_completion" for c in chunks)


async def test_without_the_routers_count_the_prompt_is_counted_by_the_engines_tokenize(nursery):
    sims, states, prompt = await three_engines(nursery)
    sims[0].faults.die_after = 20
    sink = Sink()
    await forward(states, exchange(sink, CHAT), max_attempts=3)
    assert_one_complete_answer(sink, 300, prompt)


async def test_at_most_k_continuations_then_the_sse_error_as_before(nursery):
    sims, states, prompt = await three_engines(nursery)
    for sim in sims:
        sim.faults.error_after = 5
    sink = Sink()
    result = await forward(states, exchange(sink, CHAT, prompt_tokens=prompt), max_attempts=3)
    assert len(result.continuations) == 2
    last = json.loads(sink.body.split(b"\n\n")[-2][6:])
    assert "continuation limit" in last["error"]["message"]


async def test_a_stream_that_cannot_be_spliced_ends_with_the_sse_error(nursery):
    sims, states, prompt = await three_engines(nursery)
    sims[0].faults.die_after = 5
    sink = Sink()
    body = {**CHAT, "logprobs": True}
    result: ProxyResult = await forward(states, exchange(sink, body, prompt_tokens=prompt), max_attempts=3)
    assert not result.continuations and result.broken_after_first_byte
    assert b'"error"' in sink.body.split(b"\n\n")[-2]


async def test_a_drain_deadline_moves_running_streams_without_charging_the_engine(nursery):
    sims, states, prompt = await three_engines(nursery)

    def drain() -> None:
        states[0].draining = True
        states[0].pool.drain_at = trio.current_time()

    sink = CountingSink(20, drain)
    result = await forward(states, exchange(sink, CHAT, prompt_tokens=prompt), max_attempts=3)
    assert_one_complete_answer(sink, 300, prompt)
    assert result.continuations[0].reason == "drained" and failures(states[0]) == 0
    await trio.sleep(0.1)
    assert sims[0].inflight == 0, "the drained engine stopped generating"
    states[0].draining = False  # back in rotation (PATCH draining=false): an old deadline no longer applies
    sink = Sink()
    result = await forward([states[0]], exchange(sink, CHAT, prompt_tokens=prompt), max_attempts=1)
    assert not result.continuations and sink.body.endswith(b"data: [DONE]\n\n")


async def test_a_budget_spent_at_the_break_ends_the_stream_without_another_engine(nursery):
    sims, states, prompt = await three_engines(nursery)
    sims[0].faults.die_after = 20
    sink = Sink()
    result = await forward(states, exchange(sink, {**CHAT, "max_tokens": 20}, prompt_tokens=prompt), max_attempts=3)
    assert not result.continuations
    assert_one_complete_answer(sink, 20, prompt)


async def test_a_non_streamed_request_whose_engine_dies_is_generated_again_elsewhere(nursery):
    sims, states = await sim_engines(nursery, 3)
    sims[0].faults.die_after = 20
    sink = Sink()
    body = {**CHAT, "stream": False}
    del body["stream_options"]
    result = await forward(states, Exchange("POST", "/v1/chat/completions", json.dumps(body).encode(),
                                            [("content-type", "application/json")], sink.send, Timeouts(),
                                            lambda engine, attempts: [], False), max_attempts=3)
    answer = json.loads(sink.body)
    assert sink.status == 200 and answer["usage"]["completion_tokens"] == 300
    assert [a.outcome.split(" ")[0] for a in result.attempts] == ["lost", "ok"]


async def test_a_non_streamed_request_two_engines_died_on_gets_a_502_and_no_third_engine(nursery):
    """A query of death: the request may be what kills the engines, so no third one is risked or charged."""
    sims, states = await sim_engines(nursery, 4)
    for sim in sims:
        sim.faults.die_after = 5
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50}
    sink = Sink()
    with pytest.raises(UpstreamFailure) as caught:
        await forward(states, Exchange("POST", "/v1/completions", json.dumps(body).encode(), [], sink.send,
                                       Timeouts(), lambda engine, attempts: [], False), max_attempts=4)
    assert caught.value.status == 502 and caught.value.code == "engines_died_on_request"
    assert [a.outcome.split(" ")[0] for a in caught.value.attempts] == ["lost", "lost"]
    assert all(sim.success == {} and sim.inflight == 0 for sim in sims[2:]), "generated in full a third time"
    assert [failures(s) for s in states[2:]] == [0, 0]


async def test_a_client_gone_during_a_continuation_stops_the_next_engine(nursery):
    sims, states, prompt = await three_engines(nursery)
    sims[0].faults.die_after = 5
    with trio.CancelScope() as scope:
        await forward(states, exchange(CountingSink(10, scope.cancel), CHAT, prompt_tokens=prompt), max_attempts=3)
    await trio.sleep(0.2)
    assert sims[1].success == {} and sims[1].inflight == 0 and [s.in_flight for s in states] == [0, 0, 0]


async def test_an_engine_counts_a_stream_as_waiting_until_its_first_token_reached_the_client(nursery):
    """Its event ingest lets such streams go first (gateway/first_tokens.py): the count must fall as soon
    as the first token is out, and must not stay up after the stream."""
    sims, states, prompt = await three_engines(nursery)
    seen: list[tuple[int, int]] = []
    sink = Sink()
    send = sink.send

    async def watching(message: dict[str, Any]) -> None:
        tokens = len(re.findall(rb'"content":"[^"]', sink.body))  # the role-only event has "content":""
        seen.append((tokens, states[0].first_tokens.count))  # tokens the client had before this send
        await send(message)

    sink.send = watching
    await forward(states, exchange(sink, dict(CHAT, max_tokens=5), prompt_tokens=prompt), max_attempts=3)
    assert seen[0] == (0, 1)  # the head: the first token is still to come
    assert all(count == 0 for chunks, count in seen if chunks >= 1)
    assert states[0].first_tokens.count == 0
