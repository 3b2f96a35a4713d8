"""Sampling integers outside what vLLM takes are refused with a 400 in OpenAI's shape before any engine sees
them: ``top_k = 2**63`` fits 64 bits, passed the body's range check, and made every engine answer 500."""

from __future__ import annotations

import json

import pytest
from router_inprocess import MODEL, StubUpstream, assert_openai_error, call, make_router

from gateway.openai_errors import ApiError
from gateway.request_body import INT_MIN, SAMPLING_INT_RANGES, parse_request

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.mark.parametrize("key", SAMPLING_INT_RANGES)
def test_every_sampling_integer_is_refused_just_outside_its_range_and_taken_at_its_bounds(key):
    low, high = SAMPLING_INT_RANGES[key]
    for value in (low, high):
        assert parse_request(json.dumps({**CHAT, key: value}).encode(), "chat").body[key] == value
    for value in (low - 1, high + 1):
        with pytest.raises(ApiError) as refused:
            parse_request(json.dumps({**CHAT, key: value}).encode(), "chat")
        assert refused.value.status == 400
        assert refused.value.param == (key if value >= INT_MIN else None), "below 64 bits: the body's own check"


def test_a_boolean_logprobs_is_not_an_integer_out_of_range():
    assert parse_request(json.dumps({**CHAT, "logprobs": False}).encode(), "chat").body["logprobs"] is False


@pytest.mark.parametrize(("key", "value"), [("top_k", 2**63), ("seed", 2**63), ("n", 2**40), ("top_k", -2),
                                            ("min_tokens", -1)])
async def test_the_router_answers_400_and_no_engine_sees_the_request(monkeypatch, key, value):
    upstream = StubUpstream()
    router = make_router(upstream)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "hi"})):
        answer = await call(router, "POST", path, json.dumps({**body, key: value}).encode())
        assert assert_openai_error(answer, 400)["param"] == key
    assert upstream.calls == []
