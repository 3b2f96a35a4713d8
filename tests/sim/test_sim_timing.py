"""The cost model reproduces the A40 cold/warm TTFT anchor, also through the trio scheduler."""

import random

import pytest
import trio
import zmq

from sim.config import EngineConfig
from sim.engine import SimEngine
from sim.engine_core import SimRequest
from sim.profiles import PROFILES, get_profile
from sim.timing import DecodeSeq, PrefillChunk, cold_and_warm_ttft, step_duration
from sim.tokenizer import SimTokenizer

PUBLISHED_RATIO = 166.4 / 77.4


def test_a40_profile_matches_published_cold_and_warm_ttft():
    cold, warm = cold_and_warm_ttft(get_profile("a40-qwen1.5b"), 2048, 16)
    assert cold == pytest.approx(0.1664, rel=0.03)
    assert warm == pytest.approx(0.0774, rel=0.03)


def test_h100_70b_prefills_4k_tokens_in_about_a_second():
    p = get_profile("h100-70b")
    assert step_duration(p, [PrefillChunk(4096, 0)], []) == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_costs_grow_with_uncached_tokens_and_batch_size(name):
    p = get_profile(name)
    assert step_duration(p, [PrefillChunk(2000, 0)], []) > step_duration(p, [PrefillChunk(100, 1900)], [])
    assert step_duration(p, [], [DecodeSeq(100)] * 64) > step_duration(p, [], [DecodeSeq(100)])
    assert step_duration(p, [], []) == 0.0


@pytest.fixture(scope="module")
def tokenizer():
    return SimTokenizer()


async def test_scheduler_loop_reproduces_ttft_ratio_with_time_scale(tokenizer, autojump_clock):
    """Virtual time (autojump clock): the loop's sleeps are the model's, scaled by 0.1."""
    cfg = EngineConfig(profile="a40-qwen1.5b", time_scale=0.1, events=False)
    ctx = zmq.Context()
    engine = SimEngine(cfg, tokenizer, ctx)
    prompt = list(range(100, 2148))

    async def ttft(rid):
        r = SimRequest(rid, prompt, 1, "length", random.Random(1))
        start = trio.current_time()
        async for _ in engine.run_request(r):
            return trio.current_time() - start

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        cold = await ttft("cold")
        warm = await ttft("warm")
        nursery.cancel_scope.cancel()
    ctx.term()
    assert cold == pytest.approx(0.01664, rel=0.03)
    assert cold / warm == pytest.approx(PUBLISHED_RATIO, rel=0.05)
