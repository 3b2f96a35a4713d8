"""Shared prefixes in whole blocks, and the cost model's perfect-cache TTFT floor."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import workloads
from bench.cost_floor import perfect_cache_ttft
from bench.prefix import PrefixMeter
from bench.stats import RequestResult
from sim.profiles import get_profile
from tokenization.registry import DEFAULT_TOKENIZER_DIR, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(DEFAULT_TOKENIZER_DIR))


def rendered(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32), block=st.sampled_from([16, 32, 128]))
def test_reusable_prefix_is_a_block_aligned_prefix_of_the_prompt(tokenizer, seed, block):
    conv = workloads.system_prompts(seed, prompts=1, prompt_tokens=200, requests=1)[0]
    meter = PrefixMeter(tokenizer, block)
    reusable = meter.reusable_tokens(conv.prefix_messages(0))
    full = tokenizer.encode(rendered(tokenizer, conv.messages()), add_special_tokens=False)
    system_text = rendered(tokenizer, conv.prefix_messages(0)).removesuffix("<|im_start|>assistant\n")
    system_only = tokenizer.encode(system_text, add_special_tokens=False)
    assert reusable % block == 0 and reusable <= len(system_only) < reusable + block
    assert full[:reusable] == system_only[:reusable]


def test_a_chat_turn_shares_its_history(tokenizer):
    conv = workloads.multi_turn(seed=1, conversations=1, turns=3, system_tokens=100)[0]
    meter = PrefixMeter(tokenizer, 16)
    first = meter.reusable_tokens(conv.prefix_messages(0))
    conv.record_answer(workloads.text(random.Random(1), 40))
    second = meter.reusable_tokens(conv.prefix_messages(1))
    assert 96 <= first < second and second >= first + 16 * 4
    assert meter.reusable_tokens([]) == 0


def test_assign_fills_results_from_the_turn_they_sent(tokenizer):
    convs = workloads.system_prompts(seed=2, prompts=2, prompt_tokens=200, requests=4)
    results = [RequestResult(key=c.key, status=200) for c in convs] + [RequestResult(key="unknown")]
    PrefixMeter(tokenizer, 16).assign(results, convs)
    # "System s:" and 200 one-token words in ChatML framing: 209 tokens, 13 whole blocks of 16.
    assert all(r.reusable_tokens == 208 for r in results[:4])
    assert results[-1].reusable_tokens == 0
    with pytest.raises(ValueError):
        PrefixMeter(tokenizer, 0)


def test_perfect_cache_ttft_matches_the_a40_calibration():
    # The published warm TTFT of a 2k-token prompt on an A40 (77.4 ms) that the profile was solved for.
    profile = get_profile("a40-qwen1.5b")
    assert perfect_cache_ttft(profile, 2048, 16, 1.0) == pytest.approx(0.0774, abs=0.002)
    assert perfect_cache_ttft(profile, 2048, 16, 0.5) == pytest.approx(0.0387, abs=0.001)
    # A 250-token prompt saves almost nothing: the fixed per-request cost dominates.
    assert perfect_cache_ttft(profile, 250, 16, 1.0) > 0.076
