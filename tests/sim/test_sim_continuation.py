"""The simulated engine takes vLLM's continuation parameters as vLLM does: the rendered prompt ends with
the partial assistant text, no end-of-turn token, and usage counts the continuation's own tokens."""

from __future__ import annotations

import json

import pytest
import trio

from sim.config import EngineConfig, FleetConfig
from sim.fleet import run_fleet
from sim.tokenizer import SimTokenizer
from tokenization.messages import RenderError

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok() -> SimTokenizer:
    return SimTokenizer()


def test_a_continued_final_message_is_left_open(tok):
    body = {"messages": [*USER, {"role": "assistant", "content": "Hello wor"}], "continue_final_message": True,
            "add_generation_prompt": False}
    text = tok.tok.decode(tok.prompt_ids(body, "chat"))
    assert text.endswith("<|im_start|>assistant\nHello wor")
    fresh = tok.tok.decode(tok.prompt_ids({"messages": USER}, "chat"))
    assert text == fresh + "Hello wor"


def test_continuing_and_a_generation_prompt_together_are_refused_as_vllm_does(tok):
    body = {"messages": [*USER, {"role": "assistant", "content": "x"}], "continue_final_message": True}
    with pytest.raises(RenderError, match="continue_final_message"):
        tok.prompt_ids(body, "chat")


async def test_a_continuation_is_answered_with_its_own_usage(nursery):
    [sim] = await nursery.start(run_fleet, FleetConfig(engines=1, engine=EngineConfig(profile="fast",
                                                                                      time_scale=0.05)))
    body = {"model": "kvmesh-tiny", "messages": [*USER, {"role": "assistant", "content": "Hello wor"}],
            "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 7}
    stream = await trio.open_tcp_stream("127.0.0.1", sim.info.port)
    raw = json.dumps(body).encode()
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(raw) + raw)
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    answer = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert answer["usage"]["completion_tokens"] == 7
    assert answer["usage"]["prompt_tokens"] == len(sim.tok.prompt_ids(body, "chat"))
