"""A prompt that cannot fit the model's context is refused before it is tokenized (400, OpenAI's shape)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from router_inprocess import MODEL, assert_openai_error, call, embedded_tokenizer, make_router

from gateway.body_limits import LimitsConfig
from gateway.engine_watch import Discovery

CHAT = "/v1/chat/completions"
CONTEXT = 4096
MEGABYTE = "word " * (1024 * 1024 // 5)


def chat(text: str, **extra) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}).encode()


def completion(prompt, **extra) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, **extra}).encode()


async def test_a_1mb_prompt_is_refused_without_tokenizing(monkeypatch):
    router = make_router(limits=LimitsConfig(max_model_len=CONTEXT))
    started = time.perf_counter()
    answer = await call(router, "POST", CHAT, chat(MEGABYTE))
    elapsed = time.perf_counter() - started
    error = assert_openai_error(answer, 400)
    assert error["code"] == "context_length_exceeded" and f"maximum context length is {CONTEXT}" in error["message"]
    assert router.planner.tokenizers.calls == 0
    print(f"1 MB prompt refused in {elapsed * 1000:.1f} ms")


async def test_words_refuse_a_1mb_prompt_when_the_vocabulary_has_long_tokens(monkeypatch):
    """Real vocabularies hold entries of 100+ characters (runs of spaces): the character bound alone would
    let a 1 MB prompt through to a 32k context; its 200k words cannot fit."""
    router = make_router(limits=LimitsConfig(max_model_len=32_768))
    router.planner.tokenizers.tokenizer = dataclasses.replace(embedded_tokenizer(), longest_token=256)
    answer = await call(router, "POST", CHAT, chat(MEGABYTE))
    assert assert_openai_error(answer, 400)["code"] == "context_length_exceeded"
    assert router.planner.tokenizers.calls == 0


async def test_the_engines_reported_context_is_used(monkeypatch):
    router = make_router()
    first, second = router.engines.all()
    first.max_model_len = second.max_model_len = CONTEXT
    assert (await call(router, "POST", "/v1/completions", completion([MEGABYTE, "short"]))).status == 400
    second.max_model_len = None  # an engine of unknown context might take it: the engine decides
    assert (await call(router, "POST", "/v1/completions", completion("short " * 20))).status == 200
    assert router.planner.tokenizers.calls == 1


async def test_prompts_within_the_bound_are_tokenized(monkeypatch):
    router = make_router(limits=LimitsConfig(max_model_len=CONTEXT))
    longest = embedded_tokenizer().longest_token
    assert (await call(router, "POST", "/v1/completions", completion("a" * (CONTEXT * longest)))).status == 200
    assert router.planner.tokenizers.calls == 1
    truncated = completion(MEGABYTE, truncate_prompt_tokens=100)
    assert (await call(router, "POST", "/v1/completions", truncated)).status == 200
    assert router.planner.tokenizers.calls == 2


@pytest.mark.parametrize("prompt", [list(range(CONTEXT + 1)), [[1, 2], list(range(CONTEXT + 1))]])
async def test_too_many_token_ids_are_refused(monkeypatch, prompt):
    router = make_router(limits=LimitsConfig(max_model_len=CONTEXT))
    assert_openai_error(await call(router, "POST", "/v1/completions", completion(prompt)), 400)
    assert router.planner.tokenizers.calls == 0


async def test_discovery_reads_the_context_length_from_v1_models(monkeypatch):
    router = make_router()
    engine = router.engines.all()[0]

    class Pool:
        async def get(self, target: str, timeout: float = 2.0) -> tuple[int, bytes]:
            cards = [{"id": MODEL, "object": "model", "max_model_len": 32768}, {"id": "lora", "max_model_len": 8192}]
            return 200, json.dumps({"object": "list", "data": cards}).encode()

    engine.pool = Pool()
    assert await Discovery(engine).models() == {MODEL, "lora"}
    assert engine.max_model_len == 32768
