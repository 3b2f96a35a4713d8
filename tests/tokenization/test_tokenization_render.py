"""Rendering and tokenization equal a direct HF reference built the way vLLM builds its conversation."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tokenization.messages import RenderError, detect_content_format
from tokenization.registry import DEFAULT_TOKENIZER_DIR, load_tokenizer
from tokenization.render import all_prompt_token_ids_sync, prompt_token_ids_sync, render_chat

HF = load_tokenizer(str(DEFAULT_TOKENIZER_DIR))
ROLES = ["system", "user", "assistant", "tool", "developer", "narrator"]
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS_TEMPLATE = (
    "{{ tools | tojson }}|{{ flavor | default('plain') }}|"
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
    "{% if m['tool_calls'] is defined %}{{ m['tool_calls'] | tojson }}{% endif %};{% endfor %}"
)

texts = st.text(max_size=40)
text_parts = st.one_of(texts, st.builds(lambda t: {"type": "text", "text": t}, texts),
                       st.just({"type": "text", "text": None}),
                       st.builds(lambda t: {"type": "refusal", "refusal": t}, texts))
contents = st.one_of(st.none(), texts, st.lists(text_parts, max_size=4))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": contents}),
                    min_size=1, max_size=6)


def part_text(part: object) -> str | None:
    if isinstance(part, str):
        return part
    assert isinstance(part, dict)
    return part.get("text", part.get("refusal"))


def reference_conversation(msgs: list[dict]) -> list[dict]:
    """What vLLM gives a string-format template: parts joined by newlines, null content empty."""
    out = []
    for msg in msgs:
        content = msg["content"]
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "\n".join(t for t in map(part_text, content) if t is not None)
        out.append({"role": msg["role"], "content": content})
    return out


def fresh_tokenizer(template: str):
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER_DIR))
    tok.chat_template = template
    return tok


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=messages, generation=st.booleans())
def test_chat_ids_equal_hf_reference(msgs: list[dict], generation: bool) -> None:
    body = {"messages": msgs, "add_generation_prompt": generation}
    ref = reference_conversation(msgs)
    expected_text = HF.apply_chat_template(ref, tokenize=False, add_generation_prompt=generation)
    expected_ids = HF.apply_chat_template(ref, tokenize=True, add_generation_prompt=generation,
                                          return_dict=False)
    assert render_chat(HF, body) == expected_text
    assert prompt_token_ids_sync(HF, body, "chat") == expected_ids


def test_add_special_tokens_on_chat_and_default_off() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    text = render_chat(HF, body)
    assert prompt_token_ids_sync(HF, body, "chat") == HF.encode(text, add_special_tokens=False)
    assert prompt_token_ids_sync(HF, body | {"add_special_tokens": True}, "chat") == HF.encode(text)


def test_openai_format_template_gets_parts() -> None:
    tok = fresh_tokenizer(PARTS_TEMPLATE)
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    assert detect_content_format(HF.chat_template) == "string"
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
                         {"role": "assistant", "content": "c"},
                         {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]}
    assert render_chat(tok, body) == ("<|im_start|>user\n[a][b]<|im_end|>\n<|im_start|>assistant\n[c]<|im_end|>\n"
                                      "<|im_start|>tool\nx\ny<|im_end|>\n<|im_start|>assistant\n")


def test_tools_tool_calls_and_template_kwargs() -> None:
    tok = fresh_tokenizer(TOOLS_TEMPLATE)
    body = {
        "messages": [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
            {"role": "assistant", "content": "done", "tool_calls": []},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"flavor": "spicy", "unused_by_template": 1},
    }
    tools, flavor, convo = render_chat(tok, body).split("|")
    assert json.loads(tools) == [{"type": "function",
                                  "function": {"name": "f", "description": None, "parameters": None}}]
    assert flavor == "spicy"
    first, second, _ = convo.split(";")
    assert json.loads(first.removeprefix("assistant:")) == [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": {}}}]
    assert second == "assistant:done"
    assert body["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'


def test_continue_final_message_leaves_turn_open() -> None:
    body = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}],
            "add_generation_prompt": False, "continue_final_message": True}
    assert render_chat(HF, body).endswith("<|im_start|>assistant\nThe answer is")


def test_completion_prompts() -> None:
    assert prompt_token_ids_sync(HF, {"prompt": "hello world"}, "completion") == HF.encode("hello world")
    assert prompt_token_ids_sync(HF, {"prompt": [5, 6, 7]}, "completion") == [5, 6, 7]
    batch = all_prompt_token_ids_sync(HF, {"prompt": ["ab", [9, 8]]}, "completion")
    assert batch == [HF.encode("ab"), [9, 8]]
    long_ids = HF.encode("one two three four five six", add_special_tokens=False)
    body = {"prompt": "one two three four five six", "truncate_prompt_tokens": 3}
    assert prompt_token_ids_sync(HF, body, "completion") == long_ids[-3:]
    body["truncation_side"] = "right"
    assert prompt_token_ids_sync(HF, body, "completion") == long_ids[:3]


@pytest.mark.parametrize(("body", "kind", "param"), [
    ({"messages": "hi"}, "chat", "messages"),
    ({"messages": [{"content": "no role"}]}, "chat", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "chat",
     "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "chat", "messages"),
    ({"messages": [], "add_generation_prompt": True, "continue_final_message": True}, "chat",
     "continue_final_message"),
    ({"messages": [], "chat_template": "{{ 1 }}"}, "chat", "chat_template"),
    ({"messages": [], "chat_template_kwargs": {"tokenize": True}}, "chat", "chat_template_kwargs"),
    ({"messages": [], "tools": []}, "chat", "tools"),
    ({"prompt": [1, 10**9]}, "completion", "prompt"),
    ({"prompt": ""}, "completion", "prompt"),
    ({"prompt": []}, "completion", "prompt"),
    ({"prompt": [[]]}, "completion", "prompt"),
    ({}, "completion", "prompt"),
    ({"prompt": "x", "truncate_prompt_tokens": "3"}, "completion", "truncate_prompt_tokens"),
])
def test_invalid_requests_are_render_errors(body: dict, kind: str, param: str) -> None:
    with pytest.raises(RenderError) as info:
        prompt_token_ids_sync(HF, body, kind)  # type: ignore[arg-type]
    assert info.value.param == param


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
message_like = st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name", "type", "text"]),
                               json_values, max_size=4)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["messages", "prompt", "tools", "add_generation_prompt",
                                             "chat_template_kwargs", "truncate_prompt_tokens"]),
                            json_values | st.lists(message_like, max_size=3), max_size=4),
       kind=st.sampled_from(["chat", "completion"]))
def test_malformed_bodies_raise_only_render_errors(body: dict, kind: str) -> None:
    try:
        ids = prompt_token_ids_sync(HF, body, kind)  # type: ignore[arg-type]
    except RenderError as exc:
        assert exc.message
    else:
        assert ids and all(isinstance(t, int) for t in ids)
