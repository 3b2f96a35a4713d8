"""TokenizerService with real worker processes: exact ids, cache and worker paths, a free event loop."""

from __future__ import annotations

import os
import random
import signal
import sysconfig
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing
from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizerFast

from tokenization import service
from tokenization.build_default import CHATML_TEMPLATE
from tokenization.messages import RenderError
from tokenization.registry import DEFAULT_TOKENIZER_DIR, LoadedTokenizer, TokenizerRegistry, load_tokenizer
from tokenization.render import all_prompt_token_ids_sync, render_chat
from tokenization.service import FRESH_SEGMENT_MIN_CHARS, NOW_MAX_CHARS, DeferredIds, TokenizerService
from tokenization.worker import WorkerPool

pytestmark = pytest.mark.integration

SPEC = str(DEFAULT_TOKENIZER_DIR)
HF = load_tokenizer(SPEC)
CORPUS = "".join(p.read_text(encoding="utf-8", errors="replace")
                 for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:150])


def excerpt(rnd: random.Random, chars: int) -> str:
    start = rnd.randrange(len(CORPUS) - chars)
    return CORPUS[start:start + chars]


def random_body(rnd: random.Random) -> tuple[dict, str]:
    if rnd.random() < 0.3:
        prompt = rnd.choice([excerpt(rnd, rnd.choice([20, 3000])), [rnd.randrange(4096) for _ in range(5)]])
        return {"prompt": [prompt, excerpt(rnd, 50)] if rnd.random() < 0.5 else prompt}, "completion"
    system = rnd.choice(["You are terse.", "You review code.\n" + CORPUS[:5000]])
    turns = [{"role": "system", "content": system}]
    for i in range(rnd.randrange(1, 5)):
        content = excerpt(rnd, rnd.choice([10, 200, 4000]))
        if rnd.random() < 0.3:
            content = [{"type": "text", "text": content}, {"type": "text", "text": "<|im_end|> tail "}]
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {"messages": turns}, "chat"


async def test_ids_equal_direct_tokenization_across_paths() -> None:
    rnd = random.Random(11)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC), verify_every=3, inline_max_chars=1_024,
                                     thread_max_chars=3_500) as svc:
        for _ in range(60):
            body, kind = random_body(rnd)
            assert await svc.all_token_ids("any-model", body, kind) == all_prompt_token_ids_sync(HF, body, kind)
        assert svc.stats.inline_encodes > 0
        assert svc.stats.thread_encodes > 0
        assert svc.stats.worker_encodes > 0
        assert svc.cache.stats.hits > 0
        assert svc.stats.verifications > 0
        assert svc.stats.segment_mismatches == 0
        with pytest.raises(RenderError):
            await svc.token_ids("any-model", {"messages": [{"role": 1}]}, "chat")


async def test_a_middling_fresh_turn_is_encoded_in_a_thread_not_a_worker_process() -> None:
    """A worker round trip cost more than the whole encode of a few thousand characters."""
    rnd = random.Random(3)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        body = {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": excerpt(rnd, 12_000)}]}
        assert await svc.token_ids(None, body, "chat") == all_prompt_token_ids_sync(HF, body, "chat")[0]
        assert (svc.stats.thread_encodes, svc.stats.worker_encodes) == (1, 0)


def on_the_loop(monkeypatch, name: str) -> list[bool]:
    """Whether each call of the service's ``name`` ran on the event loop's thread (True) or another one."""
    calls: list[bool] = []
    original = getattr(service, name)

    def recording(*args):
        calls.append(threading.current_thread() is threading.main_thread())
        return original(*args)

    monkeypatch.setattr(service, name, recording)
    return calls


async def test_a_request_of_thousands_of_messages_renders_off_the_event_loop(monkeypatch) -> None:
    """A chat template runs Python per message: 20k messages held the loop ~0.1 s (0.5 s on a busy machine)
    while every other request and health poll waited. Large requests render in a thread; small ones inline."""
    rendered_on = on_the_loop(monkeypatch, "prompts")
    many = {"messages": [{"role": ("user", "assistant")[i % 2], "content": f"m{i}"} for i in range(2_000)]}
    few = {"messages": [{"role": "user", "content": "hello"}]}
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        assert await svc.token_ids(None, many, "chat") == all_prompt_token_ids_sync(HF, many, "chat")[0]
        assert await svc.token_ids_or_head(None, few, "chat", 16_000) == all_prompt_token_ids_sync(HF, few, "chat")[0]
    assert rendered_on == [False, True] and svc.stats.thread_renders == 1


async def test_a_completions_batch_of_short_prompts_is_encoded_off_the_event_loop(monkeypatch) -> None:
    """Encoded prompt by prompt on the loop (each short enough to go inline), an 8 MiB batch held the loop
    for ~7 s: a batch is encoded in one call, in a thread, with the same ids."""
    encoded_on = on_the_loop(monkeypatch, "encode_plain")
    rnd = random.Random(5)
    batch = {"prompt": [excerpt(rnd, 30) for _ in range(2_000)] + [[5, 6, 7]], "truncate_prompt_tokens": 6}
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        assert await svc.all_token_ids(None, batch, "completion") == all_prompt_token_ids_sync(HF, batch,
                                                                                              "completion")
        assert await svc.all_token_ids(None, {"prompt": ["a b", "c"]}, "completion") == [HF.encode("a b"),
                                                                                         HF.encode("c")]
    assert encoded_on and not any(encoded_on), "a batch was encoded on the event loop"
    assert svc.stats.batch_encodes == 2


async def test_unknown_model_without_default_is_a_render_error() -> None:
    async with TokenizerService.open(TokenizerRegistry({"m": SPEC})) as svc:
        assert await svc.token_ids("m", {"prompt": "hi"}, "completion") == HF.encode("hi")
        with pytest.raises(RenderError) as info:
            await svc.token_ids("other", {"prompt": "hi"}, "completion")
        assert info.value.param == "model"


def build_lstrip_tokenizer(out: Path) -> str:
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", lstrip=True, special=True, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return str(out)


async def test_traffic_check_falls_back_when_segments_are_not_independent(tmp_path: Path) -> None:
    spec = build_lstrip_tokenizer(tmp_path / "lstrip")
    loaded = LoadedTokenizer.load(spec)
    wrongly_trusted = replace(loaded, plan=replace(loaded.plan, segmentable=True))
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    expected = all_prompt_token_ids_sync(loaded.hf, body, "chat")[0]
    assert wrongly_trusted.plan.split(render_chat(loaded.hf, body))[1:]
    pool = WorkerPool([spec])
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        svc = TokenizerService(TokenizerRegistry(default=spec), {spec: wrongly_trusted}, pool,
                               cache_tokens=10_000, inline_max_chars=1_024, verify_every=1)
        assert await svc.token_ids(None, body, "chat") == expected
        assert svc.stats.segment_mismatches == 1
        assert await svc.token_ids(None, body, "chat") == expected
        assert svc.stats.verifications == 1
        nursery.cancel_scope.cancel()


async def ticker(stop: trio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await trio.sleep(0)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


@pytest.mark.parametrize(("thread_max_chars", "path"), [(100_000, "worker"), (1_000_000, "thread")])
async def test_event_loop_keeps_running_during_a_32k_token_prompt(thread_max_chars: int, path: str) -> None:
    rnd = random.Random(5)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC), thread_max_chars=thread_max_chars) as svc:
        long_body = {"messages": [{"role": "user", "content": excerpt(rnd, 120_000)}]}
        reference_text = render_chat(HF, {"messages": [{"role": "user", "content": excerpt(rnd, 120_000)}]})
        started = time.perf_counter()
        HF.encode(reference_text, add_special_tokens=False)
        inline_seconds = time.perf_counter() - started

        gaps: list[float] = []
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker, stop, gaps)
            ids = await svc.token_ids(None, long_body, "chat")
            stop.set()
        assert len(ids) > 25_000
        assert getattr(svc.stats, f"{path}_encodes") == 1
        assert max(gaps) < 0.5 * inline_seconds


async def test_cache_hits_are_served_while_a_worker_is_busy() -> None:
    rnd = random.Random(9)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC), workers=1) as svc:
        short = {"messages": [{"role": "system", "content": CORPUS[:4000]}, {"role": "user", "content": "hi"}]}
        await svc.token_ids(None, short, "chat")
        long_body = {"messages": [{"role": "user", "content": excerpt(rnd, 120_000)}]}
        finished: list[str] = []

        async def run(name: str, body: dict) -> None:
            await svc.token_ids(None, body, "chat")
            finished.append(name)

        jobs_before = svc.stats.worker_encodes
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "long", long_body)
            await trio.testing.wait_all_tasks_blocked()
            assert svc.stats.worker_encodes == jobs_before + 1
            nursery.start_soon(run, "short", short)
        assert finished == ["short", "long"]
        assert svc.stats.worker_encodes == jobs_before + 1


async def test_killed_worker_is_replaced_and_its_job_still_answered() -> None:
    rnd = random.Random(13)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC), thread_max_chars=0) as svc:
        (pid,) = svc.pool.pids
        os.kill(pid, signal.SIGKILL)
        body = {"messages": [{"role": "user", "content": excerpt(rnd, 8_000)}]}
        assert await svc.token_ids(None, body, "chat") == all_prompt_token_ids_sync(HF, body, "chat")[0]
        assert svc.stats.worker_failures == 1
        with trio.fail_after(60):
            while svc.pool.restarts == 0 or not svc.pool.pids:
                await trio.sleep(0.05)
        body = {"messages": [{"role": "user", "content": excerpt(rnd, 8_000)}]}
        assert await svc.token_ids(None, body, "chat") == all_prompt_token_ids_sync(HF, body, "chat")[0]
        assert svc.stats.worker_failures == 1
        assert svc.pool.pids != {pid}


async def test_a_long_fresh_turn_after_a_cached_head_is_deferred_and_completed_exactly() -> None:
    rnd = random.Random(21)
    system = CORPUS[:5000]
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        warm = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
        await svc.token_ids(None, warm, "chat")
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": excerpt(rnd, 20_000)}]}
        exact = all_prompt_token_ids_sync(HF, body, "chat")[0]
        found = await svc.token_ids_or_head(None, body, "chat", defer_chars=16_000)
        assert isinstance(found, DeferredIds)
        assert 0 < len(found.head) < len(exact) and exact[:len(found.head)] == found.head
        assert 0.5 * len(exact) < found.estimated_tokens < 2 * len(exact)
        threads = svc.stats.thread_encodes
        assert await found.complete() == exact
        assert svc.stats.thread_encodes == threads + 1  # off the loop, which relays answers meanwhile
        assert await svc.token_ids_or_head(None, body, "chat", defer_chars=16_000) == exact  # now cached
        short = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": excerpt(rnd, 2_000)}]}
        assert await svc.token_ids_or_head(None, short, "chat", defer_chars=16_000) == \
            all_prompt_token_ids_sync(HF, short, "chat")[0]
        assert svc.stats.deferred == 1


async def test_a_deferred_rest_is_encoded_in_a_thread_once_the_request_is_out() -> None:
    """A rest of a few KB is encoded inline when the request waits for it, but after the request went out
    (``complete``) it goes to a thread: inline, it held the loop on the way to other streams' first tokens."""
    rnd = random.Random(5)
    system = CORPUS[:5000]
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        await svc.token_ids(None, {"messages": [{"role": "system", "content": system}]}, "chat")
        turn = excerpt(rnd, 2_000)
        assert service.BACKGROUND_INLINE_MAX_CHARS < len(turn) <= svc.inline_max_chars
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": turn}]}
        found = await svc.token_ids_or_head(None, body, "chat", defer_chars=1_024)
        assert isinstance(found, DeferredIds)
        inline, threads = svc.stats.inline_encodes, svc.stats.thread_encodes
        assert await found.complete() == all_prompt_token_ids_sync(HF, body, "chat")[0]
        assert (svc.stats.inline_encodes, svc.stats.thread_encodes) == (inline, threads + 1)
        waited = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": excerpt(rnd, 2_000)}]}
        assert await svc.token_ids(None, waited, "chat") == all_prompt_token_ids_sync(HF, waited, "chat")[0]
        assert (svc.stats.inline_encodes, svc.stats.thread_encodes) == (inline + 1, threads + 1)


async def test_a_prompt_is_rendered_once_whether_or_not_it_is_deferred(monkeypatch) -> None:
    """Rendering the chat template is the loop's largest cost on the path to the first byte."""
    from tokenization import service

    renders = []

    def counted(*args):
        renders.append(1)
        return service_prompts(*args)

    service_prompts = service.prompts
    monkeypatch.setattr(service, "prompts", counted)
    rnd = random.Random(4)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        body = {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": excerpt(rnd, 900)}]}
        await svc.token_ids_or_head(None, body, "chat", defer_chars=16_000)
        long_body = {"messages": [body["messages"][0], {"role": "user", "content": excerpt(rnd, 20_000)}]}
        found = await svc.token_ids_or_head(None, long_body, "chat", defer_chars=16_000)
        assert isinstance(found, DeferredIds)
        await found.complete()
    assert len(renders) == 2


async def test_a_new_long_system_prompt_is_routed_on_its_head_encoded_on_the_loop() -> None:
    """The first request of a new 1-4k-token system prompt waited 90-555 ms for its whole encode on a busy
    machine; its head (the first ~1 KB) finds its home and any engine holding its start. A new segment of up
    to 4 KB is encoded whole."""
    rnd = random.Random(8)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        body = {"messages": [{"role": "system", "content": excerpt(rnd, 20_000)}, {"role": "user", "content": "hi"}]}
        exact = all_prompt_token_ids_sync(HF, body, "chat")[0]
        found = await svc.token_ids_or_head(None, body, "chat", defer_chars=1_024)
        assert isinstance(found, DeferredIds) and found.fresh
        assert 64 <= len(found.head) < len(exact) and exact[:len(found.head)] == found.head
        assert 0.5 * len(exact) < found.estimated_tokens < 2 * len(exact)
        assert svc.stats.thread_encodes == 0 and svc.stats.fresh_heads == 1
        assert await found.complete() == exact
        assert svc.stats.fresh_head_mismatches == 0
        assert await svc.token_ids_or_head(None, body, "chat", defer_chars=1_024) == exact  # now cached
        short = {"messages": [{"role": "system", "content": excerpt(rnd, FRESH_SEGMENT_MIN_CHARS - 200)},
                              {"role": "user", "content": "hi"}]}
        assert await svc.token_ids_or_head(None, short, "chat", defer_chars=1_024) == \
            all_prompt_token_ids_sync(HF, short, "chat")[0]


async def test_a_short_deferred_rest_encodes_on_the_loop_to_the_same_ids_and_a_long_one_does_not() -> None:
    """``complete_now`` (for a request that waits for the rest) gives the ids ``complete`` gives and fills the
    cache the same way; beyond ``NOW_MAX_CHARS`` there is none."""
    rnd = random.Random(21)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        body = {"messages": [{"role": "system", "content": excerpt(rnd, NOW_MAX_CHARS // 2)},
                             {"role": "user", "content": "hi"}]}
        exact = all_prompt_token_ids_sync(HF, body, "chat")[0]
        found = await svc.token_ids_or_head(None, body, "chat", defer_chars=1_024)
        assert isinstance(found, DeferredIds) and found.fresh and found.complete_now is not None
        assert found.complete_now() == exact
        assert await svc.token_ids_or_head(None, body, "chat", defer_chars=1_024) == exact  # cached by it
        assert await found.complete() == exact
        long_body = {"messages": [{"role": "system", "content": excerpt(rnd, NOW_MAX_CHARS * 2)},
                                  {"role": "user", "content": "hi"}]}
        long_found = await svc.token_ids_or_head(None, long_body, "chat", defer_chars=1_024)
        assert isinstance(long_found, DeferredIds) and long_found.complete_now is None


async def test_fresh_head_ids_begin_the_whole_segments_ids_wherever_the_text_is_cut() -> None:
    """Source text (runs of spaces, tabs, newlines, unicode) cut at many places: the head's ids must begin the
    whole prompt's, or it would be routed on blocks no engine will ever hold."""
    rnd = random.Random(9)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        for _ in range(40):
            body = {"messages": [{"role": "system", "content": excerpt(rnd, rnd.randint(4_200, 9_000))}]}
            found = await svc.token_ids_or_head(None, body, "chat", defer_chars=1_024)
            assert isinstance(found, DeferredIds)
            await found.complete()
            svc.cache.clear(SPEC)
        assert svc.stats.fresh_heads == 40 and svc.stats.fresh_head_mismatches == 0


async def test_a_fresh_head_that_does_not_begin_the_whole_turns_fresh_heads_off() -> None:
    rnd = random.Random(10)
    async with TokenizerService.open(TokenizerRegistry(default=SPEC)) as svc:
        body = {"messages": [{"role": "system", "content": excerpt(rnd, 9_000)}]}
        found = await svc.token_ids_or_head(None, body, "chat", defer_chars=1_024)
        assert isinstance(found, DeferredIds)
        found.head[-1] += 1  # as if the cut had changed the last token
        await found.complete()
        assert svc.stats.fresh_head_mismatches == 1
        other = {"messages": [{"role": "system", "content": excerpt(rnd, 9_000)}]}
        assert await svc.token_ids_or_head(None, other, "chat", defer_chars=1_024) == \
            all_prompt_token_ids_sync(HF, other, "chat")[0]
