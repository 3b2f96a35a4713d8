"""The stream splicer and continuation requests (sans-IO): whatever the chunk boundaries and wherever the
first engine breaks, the client sees one well-formed stream."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.continuation import ContinuationSpec, StreamSplicer, continuation_body, why_not_continuable
from sim.openai_api import DONE, ResponseHead, sse, usage

PROMPT_TOKENS = 17


def stream(head: ResponseHead, pieces: list[str], finish: str | None = "length", include_usage: bool = True,
           prompt_tokens: int = PROMPT_TOKENS) -> bytes:
    """A stream as the simulated engine (vLLM's framing) sends it."""
    out = [head.role_chunk()] if head.chat else []
    for i, piece in enumerate(pieces):
        out.append(head.text_chunk(piece, finish if i == len(pieces) - 1 else None))
    if include_usage:
        out.append(head.usage_chunk(usage(prompt_tokens, len(pieces), 3)))
    return b"".join(out) + DONE


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def client_events(data: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: "):
            payload = event[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def content(event: dict, chat: bool) -> str:
    if not event["choices"]:
        return ""
    choice = event["choices"][0]
    return (choice["delta"].get("content") or "") if chat else choice["text"]


words = st.lists(st.text(alphabet='abc xyz\u00e9\u4e2d"\\\n\U0001f600', min_size=1, max_size=4), min_size=1,
                 max_size=12)
cuts = st.lists(st.integers(0, 4000), max_size=12)


@given(st.booleans(), words, cuts)
def test_an_unbroken_stream_passes_through_byte_for_byte(chat, pieces, at):
    original = stream(ResponseHead("chatcmpl-a" if chat else "cmpl-a", 100, "m", chat), pieces)
    splicer = StreamSplicer("chat" if chat else "completion", include_usage=True)
    out = b"".join(splicer.feed(c) for c in split(original, at))
    assert out == original
    assert splicer.done and splicer.finished and splicer.tokens == len(pieces)
    assert splicer.generated == "".join(pieces)


@given(st.booleans(), words, words, st.integers(0, 4000), cuts, cuts, st.booleans())
def test_a_continued_stream_looks_like_one_stream(chat, first, second, broken_at, cuts1, cuts2, include_usage):
    kind = "chat" if chat else "completion"
    original = stream(ResponseHead("id-1", 100, "m", chat), first, include_usage=include_usage)
    broken = original[:min(broken_at, len(original) - len(DONE) - 1)]
    splicer = StreamSplicer(kind, include_usage=include_usage, prompt_tokens=PROMPT_TOKENS)
    out = b"".join(splicer.feed(c) for c in split(broken, cuts1))
    assert not splicer.done
    sent_tokens, sent_text, from_first = splicer.tokens, splicer.generated, out
    splicer.begin_continuation()
    rest = stream(ResponseHead("id-2", 200, "m2", chat), second, include_usage=include_usage,
                  prompt_tokens=PROMPT_TOKENS + 40)
    if splicer.finished:  # broke between the finish chunk and the end: nothing to continue
        out += splicer.ending(None)
        second = []
    else:
        out += b"".join(splicer.feed(c) for c in split(rest, cuts2))
    events = client_events(out)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events if isinstance(e, dict)]
    identity = ("id-1", 100, "m") if from_first else ("id-2", 200, "m2")
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {identity}
    assert all(choice["index"] == 0 for c in chunks for choice in c["choices"])
    assert sum(1 for c in chunks for choice in c["choices"] if choice.get("finish_reason")) == 1
    if chat:
        assert sum(1 for c in chunks for choice in c["choices"] if "role" in choice["delta"]) <= 1
    assert "".join(content(c, chat) for c in chunks) == sent_text + "".join(second)
    usages = [c["usage"] for c in chunks if c.get("usage")]
    if include_usage:
        assert len(usages) == 1 and usages[0]["completion_tokens"] == sent_tokens + len(second)
        assert usages[0]["prompt_tokens"] == PROMPT_TOKENS
        assert usages[0]["total_tokens"] == PROMPT_TOKENS + sent_tokens + len(second)
    else:
        assert not usages


@given(words, st.integers(0, 11), cuts)
def test_an_engine_error_event_is_never_forwarded(pieces, after, at):
    head = ResponseHead("id-1", 100, "m", True)
    after = min(after, len(pieces))
    error = sse({"error": {"message": "engine overloaded", "type": "InternalServerError", "code": 500}})
    original = head.role_chunk() + b"".join(head.text_chunk(p, None) for p in pieces[:after]) + error + DONE
    splicer = StreamSplicer("chat")
    out = b"".join(splicer.feed(c) for c in split(original, at))
    assert splicer.engine_error == "engine overloaded" and not splicer.done
    assert b"error" not in out and b"[DONE]" not in out
    assert splicer.tokens == after


def test_tool_calls_or_reasoning_in_the_answer_make_it_unsplicable():
    head = ResponseHead("id-1", 100, "m", True)
    for delta in ({"reasoning_content": "hmm"}, {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}):
        splicer = StreamSplicer("chat")
        event = sse({"id": "id-1", "object": "chat.completion.chunk", "created": 100, "model": "m",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        assert splicer.feed(head.role_chunk() + event) == head.role_chunk() + event
        assert splicer.unsplicable is not None
    plain = StreamSplicer("chat")
    plain.feed(head.role_chunk() + head.text_chunk("the error: none", None))
    assert plain.unsplicable is None and plain.engine_error is None and plain.generated == "the error: none"


def test_ending_closes_a_stream_whose_token_budget_is_spent():
    splicer = StreamSplicer("completion", include_usage=True, prompt_tokens=5)
    head = ResponseHead("cmpl-1", 7, "m", False)
    splicer.feed(head.text_chunk("a", None) + head.text_chunk("b", None))
    events = client_events(splicer.ending("length"))
    assert events[0]["choices"][0]["finish_reason"] == "length" and events[0]["id"] == "cmpl-1"
    assert events[1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert events[2] == "[DONE]"


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "stream": True,
        "temperature": 0.7, "seed": 3}


def test_a_chat_continuation_ends_with_the_partial_answer_and_a_smaller_budget():
    body = continuation_body(CHAT, "chat", "Hello wor", 20)
    assert body["messages"] == [*CHAT["messages"], {"role": "assistant", "content": "Hello wor"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 280 and body["temperature"] == 0.7 and body["seed"] == 3
    assert CHAT["messages"] == [{"role": "user", "content": "hi"}], "the original request is not touched"


def test_a_chat_that_already_continues_its_final_message_extends_it():
    prefill = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure: "}],
               "continue_final_message": True, "add_generation_prompt": False, "max_completion_tokens": 50}
    body = continuation_body(prefill, "chat", "one", 10)
    assert body["messages"][-1] == {"role": "assistant", "content": "Sure: one"} and len(body["messages"]) == 2
    assert body["max_completion_tokens"] == 40


def test_a_completion_continuation_appends_the_text_to_the_prompt():
    assert continuation_body({"prompt": "Once", "max_tokens": 8}, "completion", " upon", 1)["prompt"] == "Once upon"
    assert continuation_body({"prompt": ["Once"]}, "completion", " upon", 1)["prompt"] == ["Once upon"]
    assert continuation_body({"prompt": "Once", "max_tokens": 8}, "completion", "x" * 8, 8) is None
    assert continuation_body(CHAT, "chat", "", 0) == CHAT, "no text yet: the request is sent again as it was"


@pytest.mark.parametrize(("extra", "kind", "reason"), [
    ({"n": 2}, "chat", "n > 1"),
    ({"logprobs": True}, "chat", "logprobs"),
    ({"logprobs": 0}, "completion", "logprobs"),
    ({"echo": True}, "completion", "echo"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "chat", "tools"),
    ({"response_format": {"type": "json_object"}}, "chat", "structured output"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "chat", "continuous usage stats"),
    ({"prompt": [1, 2, 3]}, "completion", "prompt is not text"),
])
def test_streams_that_cannot_be_spliced_are_not_continued(extra, kind, reason):
    body = {**({"prompt": "x"} if kind == "completion" else CHAT), **extra}
    assert why_not_continuable(body, kind) == reason
    assert ContinuationSpec.of(body, kind, True, 5) is None


def test_only_streams_get_a_continuation_spec():
    assert ContinuationSpec.of(CHAT, "chat", False, 5) is None
    spec = ContinuationSpec.of({**CHAT, "stream_options": {"include_usage": True}}, "chat", True, 0)
    assert spec is not None and spec.include_usage and spec.prompt_tokens is None
