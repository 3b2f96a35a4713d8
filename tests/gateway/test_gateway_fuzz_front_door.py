"""A mutation fuzzer over OpenAI bodies against a router process in front of simulated engines: no 5xx, no
connection error, every error answer JSON in OpenAI's shape, and a valid request still succeeds afterwards.

Mutations are seeded, so a failure names the seed and request that reproduce it.
"""

from __future__ import annotations

import http.client
import json
import random
from urllib.parse import urlsplit

import pytest
from gateway_http import MODEL, chat

pytestmark = pytest.mark.integration

ODD_VALUES = [None, True, 0, -1, 2**63, 2**64, 10**30, 1.5, "", "x" * 3000, "\ud800", [], [None], [[[]]], {},
              {"type": "image_url"}, {"type": "text", "text": 5}, {"a": {"b": {"c": []}}}, [1, "a", None]]
FIELDS = ["model", "messages", "prompt", "max_tokens", "stream", "user", "cache_salt", "tools", "temperature",
          "n", "chat_template_kwargs", "truncate_prompt_tokens", "max_completion_tokens", "add_special_tokens"]
RAW_EDITS = [b"[" * 5000, b"\xff\xfe", b'"\\ud800"', b"NaN", b"1e999", b"9" * 5000, b"{", b"}", b",", b'"']


def seeds() -> list[dict]:
    return [
        chat("fuzz me", stream=True),
        chat("fuzz me"),
        {"model": MODEL, "messages": [{"role": "system", "content": "s"},
                                      {"role": "user", "content": [{"type": "text", "text": "parts"}]},
                                      {"role": "assistant", "content": None, "tool_calls": [
                                          {"id": "1", "type": "function",
                                           "function": {"name": "f", "arguments": "{\"a\": 1"}}]},
                                      {"role": "tool", "content": "r", "tool_call_id": "1"}], "max_tokens": 4},
        {"model": MODEL, "prompt": "complete me", "max_tokens": 4},
        {"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4},
    ]


def mutate_value(body, rng: random.Random):
    """Replace, drop or nest one field somewhere in the body."""
    target = body
    messages = body.get("messages") if isinstance(body, dict) else None
    if isinstance(messages, list) and messages and isinstance(messages[0], dict) and rng.random() < 0.4:
        target = rng.choice([m for m in messages if isinstance(m, dict)] or [body])
    key = rng.choice(FIELDS + ["role", "content", "tool_calls"])
    action = rng.random()
    if action < 0.6:
        target[key] = rng.choice(ODD_VALUES)
    elif action < 0.8:
        target.pop(key, None)
    else:
        target[key] = [target.get(key)] * rng.randint(1, 3)
    return body


def mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        at = rng.randint(0, len(data))
        roll = rng.random()
        if roll < 0.3:
            data[at:at] = rng.choice(RAW_EDITS)
        elif roll < 0.5:
            del data[at:]
        elif roll < 0.8 and at < len(data):
            data[at] = rng.randrange(256)
        else:
            del data[at:at + rng.randint(1, 10)]
    return bytes(data)


def hostile_request(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    body = rng.choice(seeds())
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    for _ in range(rng.randint(0, 3)):
        body = mutate_value(body, rng)
    raw = json.dumps(body).encode()
    if rng.random() < 0.5:
        raw = mutate_bytes(raw, rng)
    headers = {"content-type": "application/json"}
    roll = rng.random()
    if roll < 0.05:
        headers["content-encoding"] = rng.choice(["gzip", "deflate"])
    elif roll < 0.1:
        headers["content-type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded"])
    elif roll < 0.15:
        headers["x-request-id"] = "r\u00e9q-\u00ff"
        headers["traceparent"] = "00-\u00e9"
    return path, raw, headers


def send(base: str, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.putrequest("POST", path, skip_accept_encoding=True)
        for name, value in {**headers, "content-length": str(len(raw))}.items():
            conn.putheader(name, value.encode("latin-1"))
        conn.endheaders(raw)
        response = conn.getresponse()
        return response.status, response.getheader("content-type") or "", response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzzed_bodies_get_no_5xx_and_json_errors(router, client, seed):
    rng = random.Random(seed)
    for n in range(150):
        path, raw, headers = hostile_request(rng)
        where = f"seed {seed} request {n}: {raw[:200]!r} {headers}"
        try:
            status, content_type, data = send(router.url, path, raw, headers)
        except (OSError, http.client.HTTPException) as exc:
            pytest.fail(f"connection error {exc!r} on {where}")
        assert status < 500, f"{status} {data[:300]!r} on {where}"
        if status >= 400:
            assert content_type.startswith("application/json"), where
            error = json.loads(data)["error"]
            assert isinstance(error["message"], str), where
    status, _, _ = client.request("POST", "/v1/chat/completions", chat("still fine"))
    assert status == 200


def test_a_body_over_the_limit_gets_a_413_not_a_reset(router):
    """8 MB is the default limit: the client is still writing when the router answers."""
    raw = json.dumps(chat("x" * (9 * 1024 * 1024))).encode()
    try:
        status, _, data = send(router.url, "/v1/chat/completions", raw, {"content-type": "application/json"})
    except (TimeoutError, ConnectionResetError, BrokenPipeError) as exc:
        pytest.fail(f"{exc!r} instead of a 413")
    assert status == 413 and json.loads(data)["error"]["code"] == "body_too_large"


def test_head_on_the_probe_paths_over_http(client):
    for path in ("/health", "/ready", "/metrics"):
        status, headers, data = client.request("HEAD", path, headers={})
        assert status == 200 and data == b"" and int(headers["content-length"]) > 0
