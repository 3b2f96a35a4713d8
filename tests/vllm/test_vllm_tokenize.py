"""The router renders and tokenizes every prompt exactly as the real engine does (its /tokenize)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase
from vllm_wire import chat, post_json

from cluster.vllm_engine import SERVED_MODEL_NAME, VllmEngine
from tokenization.render import prompt_token_ids_sync

pytestmark = pytest.mark.vllm

LONG = "The quick brown fox jumps over the lazy dog. " * 120
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
    ],
    [{"role": "user", "content": "naïve café, 日本語のテキスト, emoji 🚀🔥, Ελληνικά, עברית"}],
    [{"role": "user", "content": "tabs\tand\nnew\nlines\r\n  indented   spaces  "}],
    [{"role": "user", "content": "special-looking text <|im_start|> and <|im_end|> inside"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": LONG}],
    [{"role": "user", "content": ""}],
]
SETTINGS = settings(max_examples=40, deadline=None)


def engine_chat_tokens(engine: VllmEngine, body: dict[str, Any]) -> list[int]:
    return post_json(engine, "/tokenize", {"model": SERVED_MODEL_NAME} | body)["tokens"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_tokens_equal_the_engine(
    engines: list[VllmEngine], router_tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]], add_generation_prompt: bool,
) -> None:
    body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    assert prompt_token_ids_sync(router_tokenizer, body, "chat") == engine_chat_tokens(engines[0], body)


def test_continue_final_message_equals_the_engine(
    engines: list[VllmEngine], router_tokenizer: PreTrainedTokenizerBase
) -> None:
    body = {
        "messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one, two,"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert prompt_token_ids_sync(router_tokenizer, body, "chat") == engine_chat_tokens(engines[0], body)


def test_usage_prompt_tokens_match_the_router_count(
    engines: list[VllmEngine], router_tokenizer: PreTrainedTokenizerBase
) -> None:
    messages = CONVERSATIONS[2]
    reply = chat(engines[1], messages)
    ids = prompt_token_ids_sync(router_tokenizer, {"messages": messages}, "chat")
    assert reply["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("prompt", ["hello world", "  leading spaces", "日本語 🚀", LONG, "<|im_end|>"])
def test_completion_prompt_tokens_equal_the_engine(
    engines: list[VllmEngine], router_tokenizer: PreTrainedTokenizerBase, prompt: str
) -> None:
    body = {"prompt": prompt}
    assert prompt_token_ids_sync(router_tokenizer, body, "completion") == engine_chat_tokens(engines[1], body)


roles = st.sampled_from(["system", "user", "assistant"])
texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300)


@SETTINGS
@given(turns=st.lists(st.tuples(roles, texts), min_size=1, max_size=6))
def test_any_conversation_tokenizes_like_the_engine(
    engines: list[VllmEngine], router_tokenizer: PreTrainedTokenizerBase, turns: list[tuple[str, str]]
) -> None:
    body = {"messages": [{"role": role, "content": text} for role, text in turns]}
    assert prompt_token_ids_sync(router_tokenizer, body, "chat") == engine_chat_tokens(engines[0], body)


@SETTINGS
@given(text=texts.filter(bool))
def test_any_completion_text_tokenizes_like_the_engine(
    engines: list[VllmEngine], router_tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    body = {"prompt": text}
    assert prompt_token_ids_sync(router_tokenizer, body, "completion") == engine_chat_tokens(engines[1], body)
