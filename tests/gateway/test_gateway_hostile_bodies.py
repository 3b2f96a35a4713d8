"""Hostile request bodies get a 4xx in OpenAI's shape, never a 500 or an exception out of the application.

The known classes are listed one by one (each raised out of the old parser: RecursionError, ValueError,
UnicodeEncodeError, OverflowError, TypeError); hypothesis then mutates valid bodies and puts every kind of
JSON value into every field, through ``parse_request``, the exact vLLM rendering and block hashing, and
through the whole Router application in-process.
"""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_inprocess import MODEL, StubUpstream, assert_openai_error, call, make_router

from gateway.body_limits import LimitsConfig
from gateway.openai_errors import ApiError
from gateway.request_body import parse_request
from index.block_hash import chain, root_seed
from tokenization.messages import RenderError
from tokenization.registry import DEFAULT_TOKENIZER_DIR, load_tokenizer
from tokenization.render import all_prompt_token_ids_sync

CHAT = "/v1/chat/completions"
TOKENIZER = load_tokenizer(str(DEFAULT_TOKENIZER_DIR))


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


def encoded(body: dict) -> bytes:
    return json.dumps(body).encode()


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


KNOWN_HOSTILE: dict[str, tuple[bytes, str]] = {
    "nesting to 100k levels": (b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "chat"),
    "nesting past the limit": (encoded(chat_body(tools=[{"function": nested(70)}])), "chat"),
    "invalid UTF-8": (b'{"model":"m","prompt":"\xff\xfe"}', "completion"),
    "UTF-8 encoded surrogate": (b'{"model":"m","prompt":"\xed\xa0\x80"}', "completion"),
    "escaped lone surrogate": (b'{"model":"m","prompt":"\\ud800"}', "completion"),
    "lone surrogate as cache_salt": (b'{"model":"m","prompt":"x","cache_salt":"\\ud800"}', "completion"),
    "lone surrogate in a key": (b'{"model":"m","prompt":"x","\\udfff":1}', "completion"),
    "NaN": (b'{"model":"m","prompt":"x","temperature":NaN}', "completion"),
    "Infinity": (b'{"model":"m","prompt":"x","temperature":Infinity}', "completion"),
    "-Infinity": (b'{"model":"m","prompt":"x","temperature":-Infinity}', "completion"),
    "1e999": (b'{"model":"m","prompt":"x","temperature":1e999}', "completion"),
    "integer beyond 64 bits": (encoded({"model": "m", "prompt": "x", "seed": 2**64}), "completion"),
    "integer of 5,000 digits": (b'{"model":"m","prompt":"x","seed":' + b"9" * 5000 + b"}", "completion"),
    "max_tokens = 10**400": (encoded({"model": "m", "prompt": "x", "max_tokens": 10**400}), "completion"),
    "max_tokens beyond 2^31": (encoded({"model": "m", "prompt": "x", "max_tokens": 2**40}), "completion"),
    "token id beyond u32": (encoded({"model": "m", "prompt": [[1, 2**32]]}), "completion"),
    "negative token id in a batch": (encoded({"model": "m", "prompt": [[1, -1]]}), "completion"),
    "boolean token ids": (encoded({"model": "m", "prompt": [[True, False]]}), "completion"),
    "duplicate keys": (b'{"model":"m","model":"n","prompt":"x"}', "completion"),
    "truncated body": (encoded(chat_body())[:-7], "chat"),
    "top-level array": (b"[1, 2]", "chat"),
    "top-level string": (b'"hello"', "chat"),
    "top-level null": (b"null", "chat"),
    "empty body": (b"", "chat"),
    "whitespace body": (b" \r\n ", "chat"),
    "UTF-16 body": (json.dumps(chat_body()).encode("utf-16"), "chat"),
    "content as an object": (encoded(chat_body(messages=[{"role": "user", "content": {"a": 1}}])), "chat"),
    "content parts of odd types": (encoded(chat_body(messages=[{"role": "user", "content": [1, None, []]}])),
                                   "chat"),
    "content part without a type": (encoded(chat_body(messages=[{"role": "user", "content": [{"text": "x"}]}])),
                                    "chat"),
    "null everywhere": (encoded({"model": None, "messages": None, "max_tokens": None}), "chat"),
    "null message": (encoded(chat_body(messages=[None])), "chat"),
    "stream as a string": (encoded(chat_body(stream="yes")), "chat"),
    "user as a number": (encoded(chat_body(user=5)), "chat"),
    "too many messages": (encoded(chat_body(messages=[{"role": "user", "content": "x"}] * 50_000)), "chat"),
    "too many content parts": (encoded(chat_body(messages=[{"role": "user", "content": ["x"] * 1000}])), "chat"),
}


@pytest.mark.parametrize("name", KNOWN_HOSTILE)
def test_known_hostile_bodies_are_refused_with_a_4xx(name):
    raw, kind = KNOWN_HOSTILE[name]
    with pytest.raises(ApiError) as refused:
        parse_request(raw, kind)
    assert 400 <= refused.value.status < 500
    assert json.loads(refused.value.body())["error"]["type"] == "invalid_request_error"


def test_strings_beyond_the_configured_size_are_refused():
    limits = LimitsConfig(max_string_chars=1000)
    parse_request(encoded(chat_body(messages=[{"role": "user", "content": "x" * 1000}])), "chat", limits)
    with pytest.raises(ApiError) as refused:
        parse_request(encoded(chat_body(messages=[{"role": "user", "content": "x" * 1001}])), "chat", limits)
    assert refused.value.status == 413


def test_valid_bodies_still_parse():
    parsed = parse_request(encoded(chat_body(stream=None, user="u", cache_salt="s", max_completion_tokens=9,
                                             messages=[{"role": "user", "content": [{"type": "text",
                                                                                     "text": "hi"}, "x"]}])),
                           "chat")
    assert (parsed.max_tokens, parsed.user, parsed.cache_salt, parsed.stream) == (9, "u", "s", False)
    assert parse_request(encoded({"model": "m", "prompt": [[1, 2], [3]], "seed": -(2**63)}), None).kind == \
        "completion"


# Every JSON value kind, small and odd: what a fuzzer puts into a field.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20) | st.sampled_from(["", "\ud800", "text", "image_url", "system", "tool", "assistant"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "text", "role", "content", "function", "arguments", "name", "id"]), inner,
        max_size=4),
    max_leaves=12,
)
CHAT_FIELDS = ["model", "messages", "stream", "max_tokens", "max_completion_tokens", "user", "cache_salt",
               "tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
               "add_special_tokens", "truncate_prompt_tokens", "truncation_side", "documents",
               "reasoning_effort", "chat_template"]
MESSAGE_FIELDS = ["role", "content", "tool_calls", "name", "tool_call_id", "reasoning", "reasoning_content"]
tool_call = st.fixed_dictionaries({"id": json_values, "type": json_values,
                                   "function": st.fixed_dictionaries({"name": json_values,
                                                                      "arguments": st.sampled_from(
                                                                          ['{"a": 1', "{}", "[1]", "null", "{]"])
                                                                      | json_values})})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "developer"]),
                                 "content": json_values},
                                optional={"tool_calls": st.lists(tool_call, max_size=2) | json_values,
                                          **{k: json_values for k in MESSAGE_FIELDS[3:]}})
chat_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(message | json_values, min_size=1, max_size=3)},
    optional={k: json_values for k in CHAT_FIELDS[2:]},
)
completion_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL) | json_values,
     "prompt": json_values | st.lists(st.integers(-5, 2**33), max_size=4)
     | st.lists(st.lists(st.integers(-1, 5000), max_size=3), max_size=3)},
    optional={k: json_values for k in ("max_tokens", "stream", "echo", "user", "cache_salt",
                                       "add_special_tokens", "truncate_prompt_tokens")},
)


def route_like_the_planner(raw: bytes, kind) -> None:
    """What the router does with a body before forwarding it: parse, render and encode, hash blocks."""
    try:
        parsed = parse_request(raw, kind)
    except ApiError as error:
        assert 400 <= error.status < 500
        return
    try:
        ids = all_prompt_token_ids_sync(TOKENIZER, parsed.body, parsed.kind)
    except RenderError:
        return
    seed = root_seed(parsed.model, None, parsed.cache_salt)
    for prompt in ids:
        chain(prompt, 16, seed)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat_bodies)
def test_any_field_of_any_type_in_a_chat_body(body):
    route_like_the_planner(json.dumps(body).encode(), "chat")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion_bodies)
def test_any_field_of_any_type_in_a_completion_body(body):
    route_like_the_planner(json.dumps(body).encode(), "completion")


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_mutated_bytes_of_a_valid_body(data):
    raw = bytearray(encoded(chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "hé"}]}])))
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, len(raw)))
        action = data.draw(st.sampled_from(["insert", "delete", "flip", "truncate"]))
        if action == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4) | st.sampled_from(
                [b"[", b"{", b'"\\ud800"', b"NaN", b"1e999", b"9" * 30, b",", b"\xc3"]))
        elif action == "delete":
            del raw[at:at + data.draw(st.integers(1, 8))]
        elif action == "flip" and at < len(raw):
            raw[at] ^= data.draw(st.integers(1, 255))
        elif action == "truncate":
            del raw[at:]
    route_like_the_planner(bytes(raw), data.draw(st.sampled_from(["chat", "completion", None])))


# --- the whole application, in-process ---


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies | completion_bodies.map(lambda b: {**b, "_completion": True}))
async def test_the_router_answers_every_body_with_a_2xx_or_an_openai_4xx(monkeypatch, body):
    router = make_router()
    path = "/v1/completions" if body.pop("_completion", False) else CHAT
    answer = await call(router, "POST", path, json.dumps(body).encode())
    if answer.status != 200:
        assert_openai_error(answer)
    assert router.metrics.internal_errors.labels(path)._value.get() == 0


@pytest.mark.parametrize("name", ["nesting to 100k levels", "invalid UTF-8", "lone surrogate as cache_salt",
                                  "max_tokens = 10**400", "integer of 5,000 digits", "empty body"])
async def test_the_router_refuses_known_hostile_bodies(monkeypatch, name):
    raw, kind = KNOWN_HOSTILE[name]
    router = make_router()
    answer = await call(router, "POST", CHAT if kind == "chat" else "/v1/completions", raw)
    assert_openai_error(answer, 400)
    answer = await call(router, "POST", "/debug/route", raw)
    assert_openai_error(answer, 400)


@pytest.mark.parametrize(("headers", "status"), [
    ({"content-type": "application/json", "content-encoding": "gzip"}, 415),
    ({"content-type": "application/json", "content-encoding": "deflate"}, 415),
    ({"content-type": "text/plain"}, 415),
    ({"content-type": "application/x-www-form-urlencoded"}, 415),
    ({"content-type": "application/json; charset=utf-8"}, 200),
    ({"content-type": "application/vnd.api+json"}, 200),
    ({}, 200),
])
async def test_content_types_and_encodings(monkeypatch, headers, status):
    answer = await call(make_router(), "POST", CHAT, encoded(chat_body()), headers)
    assert answer.status == status
    if status != 200:
        assert assert_openai_error(answer)["code"] == "unsupported_media_type"


async def test_non_ascii_request_id_and_traceparent_are_not_forwarded(monkeypatch):
    upstream = StubUpstream()
    router = make_router(upstream)
    headers = {"content-type": "application/json", "x-request-id": "r\u00e9q", "traceparent": "00-\u00ff",
               "accept": "application/json"}
    answer = await call(router, "POST", CHAT, encoded(chat_body()), headers)
    assert answer.status == 200
    sent = dict(upstream.calls[0].headers)
    assert all(v.isascii() for _, v in upstream.calls[0].headers)
    assert "traceparent" not in sent and sent["accept"] == "application/json"
    assert [k for k, _ in upstream.calls[0].headers].count("x-request-id") == 1
    assert sent["x-request-id"] != "r\u00e9q" and answer.headers["x-request-id"] == sent["x-request-id"]
    await call(router, "POST", CHAT, encoded(chat_body()), {"x-request-id": "abc-1"})
    assert dict(upstream.calls[1].headers)["x-request-id"] == "abc-1"


async def test_an_unexpected_exception_is_a_logged_counted_500_in_openai_shape(monkeypatch, caplog):
    router = make_router(StubUpstream(error=KeyError("bug")))
    with caplog.at_level(logging.ERROR, logger="kvmesh.router"):
        answer = await call(router, "POST", CHAT, encoded(chat_body()))
    assert assert_openai_error(answer, 500)["code"] == "internal_error"
    assert router.metrics.internal_errors.labels(CHAT)._value.get() == 1
    [record] = [r for r in caplog.records if r.message == "internal error"]
    assert record.exc_info is not None and "KeyError" in caplog.text


async def test_an_exception_after_the_response_head_ends_the_body_without_a_second_head(monkeypatch):
    class FailsMidway(StubUpstream):
        async def __call__(self, engines, exchange, max_attempts):
            await exchange.send({"type": "http.response.start", "status": 200, "headers": []})
            await exchange.send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
            raise RuntimeError("bug after the head")

    router = make_router(FailsMidway())
    answer = await call(router, "POST", CHAT, encoded(chat_body(stream=True)))
    assert answer.status == 200 and answer.starts == 1 and answer.body == b"data: {}\n\n"
    assert router.metrics.internal_errors.labels(CHAT)._value.get() == 1


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"draining": true, "draining": false}', b'{"x": "\\ud800"}',
                                 b"\xff", b'{"island": 1e999}'])
async def test_the_admin_body_parser_refuses_hostile_bodies(monkeypatch, raw):
    router = make_router()
    engine = router.engines.all()[0].id
    answer = await call(router, "PATCH", f"/admin/engines/{engine}", raw)
    assert_openai_error(answer, 400)
    assert router.engines.get(engine).draining is False


async def test_an_oversized_body_is_answered_then_read_to_its_end(monkeypatch):
    """The 413 goes out first; the rest of the body is still read, so the client never sees a reset."""
    router = make_router(max_body_bytes=1000)
    answer = await call(router, "POST", CHAT, [b"x" * 600] * 3)
    assert assert_openai_error(answer, 413)["code"] == "body_too_large"
    assert answer.unread == 0
    answer = await call(router, "POST", CHAT, [b"x" * 600] * 10)
    assert answer.status == 413 and answer.unread > 0  # past twice the limit the connection is given up
