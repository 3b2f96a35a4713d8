"""Workloads are deterministic, token lengths are exact, and each shape shares what it should."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from bench import workloads
from bench.words import WORDS

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "tokenization" / "default"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def test_every_word_is_one_token(tokenizer):
    vocab = tokenizer.get_vocab()
    assert len(set(WORDS)) == len(WORDS) >= 400
    assert [w for w in WORDS if "Ġ" + w not in vocab] == []


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), tokens=st.integers(0, 3000))
def test_text_has_exactly_the_requested_token_count(tokenizer, seed, tokens):
    import random

    assert len(tokenizer.encode(workloads.text(random.Random(seed), tokens), add_special_tokens=False)) == tokens


def test_rendered_prompt_length_is_predictable(tokenizer):
    conv = workloads.system_prompts(seed=3, prompts=1, prompt_tokens=200, requests=1, user_tokens=(40, 40))[0]
    ids = tokenizer.apply_chat_template(conv.messages(), tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    # 240 words plus the "System 0:" label and the ChatML framing: a small, fixed overhead.
    assert 240 < len(ids) < 240 + 25


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32), name=st.sampled_from(workloads.WORKLOAD_NAMES))
def test_same_seed_same_requests(seed, name):
    def bodies():
        return [c.body("m", True) for c in workloads.build(name, seed, requests=24, capacity_tokens=4000)]

    assert bodies() == bodies()


def test_different_seeds_differ():
    assert workloads.build("b", 1)[0].body("m", True) != workloads.build("b", 2)[0].body("m", True)


def test_shared_documents_asks_every_document_every_question_in_shuffled_order():
    convs = workloads.shared_documents(seed=5, documents=6, questions=3)
    keys = [c.key for c in convs]
    assert sorted(keys) == sorted(f"doc{d}/q{q}" for d in range(6) for q in range(3))
    assert keys != sorted(keys)
    by_doc: dict[str, set[str]] = {}
    for c in convs:
        by_doc.setdefault(c.key.split("/")[0], set()).add(c.system or "")
    assert all(len(systems) == 1 for systems in by_doc.values())
    assert len({next(iter(s)) for s in by_doc.values()}) == 6
    assert len({c.user_turns[0] for c in convs}) == len(convs)


def test_system_prompts_use_only_the_given_prompts():
    convs = workloads.system_prompts(seed=1, prompts=5, requests=100)
    assert len(convs) == 100
    assert len({c.system for c in convs}) == 5


def test_multi_turn_history_grows_with_answers():
    conv = workloads.multi_turn(seed=2, conversations=1, turns=3)[0]
    first = conv.messages()
    conv.record_answer("one")
    second = conv.messages()
    assert second[: len(first)] == first
    assert second[len(first)] == {"role": "assistant", "content": "one"}
    conv.record_answer("")
    conv.record_answer("three")
    assert conv.done


def test_multi_turn_bodies_name_the_session():
    conv = workloads.multi_turn(seed=2, conversations=1, turns=2)[0]
    assert conv.body("m", True)["user"] == "chat0"
    single = workloads.system_prompts(seed=2, requests=1)[0]
    assert "user" not in single.body("m", True)


def test_oversized_working_set_exceeds_capacity_with_a_hot_head():
    capacity = 3 * 64 * 16
    convs = workloads.oversized_working_set(seed=9, capacity_tokens=capacity, doc_tokens=500, requests=400)
    docs = {c.system for c in convs}
    assert len(docs) * 500 > capacity
    counts = sorted((sum(c.system == d for c in convs) for d in docs), reverse=True)
    assert counts[0] > 4 * counts[len(counts) // 2]


def test_streaming_bodies_ask_for_usage():
    body = workloads.unique_prompts(seed=1, count=1)[0].body("m", True)
    assert body["stream_options"] == {"include_usage": True}
    assert "stream_options" not in workloads.unique_prompts(seed=1, count=1)[0].body("m", False)


def test_unknown_workload_and_missing_capacity_are_refused():
    with pytest.raises(ValueError):
        workloads.build("z", 1)
    with pytest.raises(ValueError):
        workloads.build("d", 1)
