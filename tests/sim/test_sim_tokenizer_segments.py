"""The simulated engine's segmented encoding gives vLLM's whole-text ids, and turns itself off when it would not."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.tokenizer import SimTokenizer
from tests.tokenization.test_tokenization_segments import SPECIALS, build_lstrip_tokenizer
from tokenization.render import prompt_token_ids_sync

SIM = SimTokenizer()
texts = st.lists(st.one_of(st.sampled_from(SPECIALS), st.text(max_size=12),
                           st.sampled_from([" ", "\n", "\n\n", "  x", "é😀", "def f():\n    return 1\n"])),
                 max_size=8).map("".join)


@settings(max_examples=150, deadline=None)
@given(system=texts, turns=st.lists(texts, min_size=1, max_size=6))
def test_a_growing_conversation_gets_the_whole_text_ids_at_every_turn(system: str, turns: list[str]) -> None:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        body = {"model": "m", "messages": list(messages)}
        assert SIM.prompt_ids(body, "chat") == prompt_token_ids_sync(SIM.tok, body, "chat")
    completion = {"model": "m", "prompt": "".join(turns)}
    if completion["prompt"]:
        assert SIM.prompt_ids(completion, "completion") == prompt_token_ids_sync(SIM.tok, completion, "completion")
    assert SIM.segmented


def test_later_turns_encode_only_their_new_segments() -> None:
    sim = SimTokenizer()
    system = {"role": "system", "content": "a long shared system prompt " * 200}
    sim.prompt_ids({"model": "m", "messages": [system, {"role": "user", "content": "first"}]}, "chat")
    misses = sim.segments.stats.misses
    sim.prompt_ids({"model": "m", "messages": [system, {"role": "user", "content": "second"}]}, "chat")
    assert sim.segments.stats.misses - misses == 1  # the new user turn; the system prompt and the rest were cached


@pytest.fixture(scope="module")
def lstrip_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(build_lstrip_tokenizer(tmp_path_factory.mktemp("lstrip")))


CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}


def test_a_tokenizer_whose_segments_are_not_independent_is_encoded_whole(lstrip_path: Path) -> None:
    sim = SimTokenizer(lstrip_path)
    assert not sim.segmented
    assert sim.prompt_ids(CHAT, "chat") == prompt_token_ids_sync(sim.tok, CHAT, "chat")


def test_a_mismatch_the_load_check_missed_turns_segments_off_at_the_first_prompt(lstrip_path: Path) -> None:
    sim = SimTokenizer(lstrip_path)
    sim.plan = replace(sim.plan, segmentable=True)  # as if the probes had passed
    sim.segmented = True
    whole = prompt_token_ids_sync(sim.tok, CHAT, "chat")
    assert sim.prompt_ids(CHAT, "chat") == whole
    assert not sim.segmented
    later = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "ok"}]}
    assert sim.prompt_ids(later, "chat") == prompt_token_ids_sync(sim.tok, later, "chat")
