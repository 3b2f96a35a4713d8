"""A Router application called in-process, without sockets: a real parse, tokenize and plan, and a stub in
place of the proxy (its own tests cover it), so hostile requests can be sent by the thousand."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from gateway.config import EngineConfig, RouterConfig
from gateway.proxy import Attempt, Exchange, ProxyResult
from gateway.replica import build_replica
from gateway.router import Router
from tokenization.registry import DEFAULT_TOKENIZER_DIR, LoadedTokenizer
from tokenization.render import all_prompt_token_ids_sync, prompt_token_ids_sync

MODEL = "m"


@cache
def embedded_tokenizer() -> LoadedTokenizer:
    return LoadedTokenizer.load(str(DEFAULT_TOKENIZER_DIR))


class InlineTokenizers:
    """The planner's tokenizer service, encoding on the spot with the embedded tokenizer."""

    def __init__(self) -> None:
        self.tokenizer = embedded_tokenizer()
        self.calls = 0

    def fewest_tokens(self, model: object, texts, above: int) -> int:
        return self.tokenizer.fewest_tokens(texts, above)

    async def token_ids(self, model: object, body: dict[str, Any], kind: str, placeholders=None) -> list[int]:
        self.calls += 1
        return prompt_token_ids_sync(self.tokenizer.hf, body, kind, placeholders)

    def token_text(self, model: object, token_id: int) -> str:
        return self.tokenizer.hf.decode([token_id])

    async def all_token_ids(self, model: object, body: dict[str, Any], kind: str) -> list[list[int]]:
        self.calls += 1
        return all_prompt_token_ids_sync(self.tokenizer.hf, body, kind)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    starts: int = 0
    unread: int = 0
    """Request body chunks the application never received."""

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class StubUpstream:
    """The router's ``forward`` seam: answers 200 from the first engine, or raises ``error``."""

    error: BaseException | None = None
    status: int = 200
    calls: list[Exchange] = field(default_factory=list)

    async def __call__(self, engines, exchange: Exchange, max_attempts: int) -> ProxyResult:
        self.calls.append(exchange)
        if self.error is not None:
            raise self.error
        engine = engines[0]
        result = ProxyResult(engine=engine, status=self.status, ttft_s=0.001, total_s=0.002,
                             attempts=[Attempt(engine.id, "ok", self.status)])
        await exchange.send({"type": "http.response.start", "status": self.status,
                             "headers": [(b"content-type", b"application/json"),
                                         *exchange.route_header(engine, result.attempts)]})
        await exchange.send({"type": "http.response.body", "body": b'{"ok": true}', "more_body": False})
        return result


def make_router(upstream: StubUpstream | None = None, **config: Any) -> Router:
    """A router with two healthy engines serving ``MODEL``, the inline tokenizer and ``upstream`` as its proxy."""
    engines = [EngineConfig(url=f"http://127.0.0.1:{port}", model=MODEL) for port in (9, 10)]
    router = build_replica(RouterConfig(engines=engines, **config), forward=upstream or StubUpstream()).router
    for engine in router.engines.all():
        engine.health.record_health(True)
        router.planner.register_engine(engine, has_events=True)
    router.planner.tokenizers = InlineTokenizers()
    return router


async def call(app, method: str, path: str, body: bytes | list[bytes] = b"",
               headers: dict[str, str] | None = None) -> Answer:
    """One ASGI request (a list of bodies arrives in chunks); fails the test if the application raises or
    sends two response heads."""
    given = {"content-type": "application/json"} if headers is None else headers
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in given.items()]}
    chunks = body if isinstance(body, list) else [body]
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, f"expected one response head, got {starts}"
    body_bytes = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    head = {k.decode(): v.decode("latin-1") for k, v in starts[0]["headers"]}
    return Answer(starts[0]["status"], head, body_bytes, len(starts), len(messages))


def assert_openai_error(answer: Answer, status: int | None = None) -> dict[str, Any]:
    """A 4xx (or the given status) with OpenAI's error object as the body."""
    if status is None:
        assert 400 <= answer.status < 500, (answer.status, answer.body[:300])
    else:
        assert answer.status == status, (answer.status, answer.body[:300])
    error = answer.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str) and "code" in error
    return error
