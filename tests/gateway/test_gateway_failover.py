"""Who pays for a failed attempt: poison requests, busy engines and long non-streamed generations
(in-process, simulated engines on loopback)."""

from __future__ import annotations

import json

import pytest
from proxy_harness import Sink, completion, failures, sim_engines

from gateway.openai_errors import ApiError
from gateway.proxy import Timeouts, UpstreamFailure, forward

pytestmark = pytest.mark.integration
POISON = {"model": "kvmesh-tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 8, "top_k": 10**30}
GOOD = {"model": "kvmesh-tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2}


def served(sim) -> int:
    return sum(sim.success.values())


async def test_a_poison_request_gets_the_engines_error_and_moves_no_breaker(nursery):
    sims, states = await sim_engines(nursery, 3)
    for _ in range(10):
        with pytest.raises(ApiError) as caught:
            await forward(states, completion(Sink(), POISON), max_attempts=3)
        error = json.loads(caught.value.body())["error"]
        assert caught.value.status == 500 and error["type"] == "internal_error" and error["message"]
    assert [s.malformed for s in sims] == [10, 10, 0], "tried on a third engine"
    assert [failures(s) for s in states] == [0, 0, 0]
    sink = Sink()
    await forward(states, completion(sink, GOOD), max_attempts=3)
    assert sink.status == 200


async def test_a_failure_on_one_engine_only_is_charged_to_that_engine(nursery):
    sims, states = await sim_engines(nursery, 2)
    sims[0].faults.fail_rate = 1.0
    sink = Sink()
    await forward(states, completion(sink, GOOD), max_attempts=2)
    assert sink.status == 200 and served(sims[1]) == 1
    assert [failures(s) for s in states] == [1, 0]


async def test_different_failures_are_charged_to_their_engines_and_end_in_503(nursery):
    sims, states = await sim_engines(nursery, 2)
    for sim, status in zip(sims, (500, 503), strict=True):
        sim.faults.fail_rate, sim.faults.fail_status = 1.0, status
    with pytest.raises(UpstreamFailure) as caught:
        await forward(states, completion(Sink(), GOOD), max_attempts=2)
    assert caught.value.status == 503 and caught.value.message.endswith("(status 500, status 503)")
    assert "127.0.0.1" not in caught.value.message, "engine addresses are for the log, not the client"
    assert [(a.engine, a.status) for a in caught.value.attempts] == [(states[0].id, 500), (states[1].id, 503)]
    assert [failures(s) for s in states] == [1, 1]


async def test_every_engine_at_429_gives_429_with_retry_after(nursery):
    sims, states = await sim_engines(nursery, 2)
    for sim in sims:
        sim.faults.fail_rate, sim.faults.fail_status = 1.0, 429
    with pytest.raises(ApiError) as caught:
        await forward(states, completion(Sink(), GOOD), max_attempts=2)
    assert caught.value.status == 429 and (b"retry-after", b"2") in caught.value.headers()
    assert [failures(s) for s in states] == [0, 0]


async def test_a_non_streamed_request_that_outlasts_the_timeout_is_a_504_and_not_generated_again(nursery):
    """vLLM sends a non-streamed answer's head only when generation ends: the engine is working, not broken."""
    sims, states = await sim_engines(nursery, 2)
    sims[0].faults.stall_s = 3.0
    with pytest.raises(ApiError) as caught:
        await forward(states, completion(Sink(), GOOD, timeouts=Timeouts(first_byte=0.5)), max_attempts=2)
    assert caught.value.status == 504
    assert served(sims[1]) == 0 and sims[1].inflight == 0, "generated again on another engine"
    assert [failures(s) for s in states] == [0, 0]


async def test_a_streamed_request_stalled_before_its_first_token_fails_over(nursery):
    sims, states = await sim_engines(nursery, 2)
    sims[0].faults.stall_s = 3.0
    sink = Sink()
    await forward(states, completion(sink, {**GOOD, "stream": True}, stream=True,
                                     timeouts=Timeouts(first_byte=0.5)), max_attempts=2)
    assert sink.status == 200 and b"data: [DONE]" in sink.body and served(sims[1]) == 1
    assert [failures(s) for s in states] == [1, 0]
