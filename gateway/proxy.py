"""Forward one request to engines in ranked order, streaming the answer back as it arrives.

The client sees nothing until an engine has produced its first body chunk, so a failure before that
point (connect error, 5xx, 429, a stall before the first token) is retried on the next candidate, with
two exceptions. A server error that a second engine repeats is the request's fault: the client gets it
(``gateway.failover``). A non-streamed request whose engine took it but has not answered in time is not
sent elsewhere: vLLM answers it only when generation ends, so the engine is still working on it; the
client gets a 504 and no breaker moves. When every engine answers 429, so does the router.
After the first byte a broken engine ends the stream with an SSE error event the OpenAI client raises.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from gateway import tracing
from gateway.engines import EngineState
from gateway.failover import ErrorAnswer, ErrorLedger
from gateway.openai_errors import ApiError, sse_error_event
from gateway.upstream import SEND_TIMEOUT_S, UpstreamError, UpstreamResponse, UpstreamTimeout

Send = Callable[[dict[str, Any]], Awaitable[None]]
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_TAIL_BYTES = 4096
ERROR_BODY_LIMIT = 64 * 1024
ERROR_BODY_TIMEOUT_S = 5.0
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"})
_OWN_RESPONSE_HEADERS = frozenset({"server", "date"})
"""Set by the router's own HTTP server."""


@dataclass
class Timeouts:
    connect: float = 2.0
    first_byte: float = 120.0
    idle: float = 120.0
    send: float = SEND_TIMEOUT_S


@dataclass
class Attempt:
    engine: str
    outcome: str
    status: int | None = None


@dataclass
class ProxyResult:
    engine: EngineState | None = None
    status: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    broken_after_first_byte: bool = False
    events: int = 0
    """SSE events of a stream (about one per output token), to learn each engine's decode speed."""
    tail: bytes = b""
    """The last bytes of the answer, where the engine's usage (cached prompt tokens) is."""

    def cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens`` as the engine reported it, if it did."""
        found = _CACHED_TOKENS.findall(self.tail)
        return int(found[-1]) if found else None


def end_to_end(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` (names in lower case) without the hop-by-hop ones, which a proxy must not forward in
    either direction (RFC 9110 7.6.1): the fixed list, every ``proxy-*`` and those ``Connection`` names."""
    named = {token.strip() for name, value in headers if name == "connection" for token in value.lower().split(",")}
    return [(k, v) for k, v in headers if k not in _HOP_BY_HOP and k not in named and not k.startswith("proxy-")]


def _upstream_headers(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """End-to-end headers, the request id once (the client's and the router's are the same value)."""
    out = []
    seen_request_id = False
    for name, value in end_to_end(headers):
        if name == "x-request-id":
            if seen_request_id:
                continue
            seen_request_id = True
        out.append((name, value))
    return out


def _response_headers(upstream: UpstreamResponse, extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    own = _OWN_RESPONSE_HEADERS | {name.decode("latin-1") for name, _ in extra}
    out = [(k.encode(), v.encode("latin-1")) for k, v in end_to_end(upstream.headers) if k not in own]
    return out + extra


def _note_chunk(result: ProxyResult, chunk: bytes) -> None:
    result.events += chunk.count(b"data: ")
    result.tail = (result.tail + chunk)[-_TAIL_BYTES:]


async def _first_chunk(upstream: UpstreamResponse, timeouts: Timeouts) -> tuple[bytes | None, Any]:
    """Read until the first body chunk so a stall or drop before it can still fail over."""
    body = upstream.iter_body(timeouts.idle)
    with trio.fail_after(timeouts.first_byte):
        async for chunk in body:
            if chunk:
                return chunk, body
    return None, body


@dataclass
class Exchange:
    """One client request as the proxy forwards it, whichever engine ends up serving it."""

    method: str
    target: str
    body: bytes
    headers: list[tuple[str, str]]
    send: Send
    timeouts: Timeouts
    route_header: Callable[[EngineState, list[Attempt]], list[tuple[bytes, bytes]]]
    is_stream: bool


@dataclass
class UpstreamFailure(ApiError):
    """An error answered after trying engines. The client's message names no engine address and no
    errno; ``attempts`` (engine and outcome, detailed) is for the router's log."""

    attempts: list[Attempt] = field(default_factory=list)

    @classmethod
    def of(cls, error: ApiError, attempts: list[Attempt]) -> UpstreamFailure:
        return cls(error.status, error.message, error.param, error.code, error.retry_after, attempts)


class _NoRetry(Exception):
    """The attempt ends the request: the client gets ``error`` and no other engine is tried."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


async def forward(candidates: list[EngineState], exchange: Exchange, max_attempts: int) -> ProxyResult:
    """Try engines in ranked order; engines whose breaker is open are skipped without using an attempt.

    An engine's error answer is charged to it only once the request turns out not to be at fault (see
    ``gateway.failover``): a second identical one ends the request with the engine's own error."""
    exchange = replace(exchange, headers=_upstream_headers(exchange.headers))
    result = ProxyResult()
    ledger = ErrorLedger()
    start = time.perf_counter()
    tried = 0
    try:
        for engine in candidates:
            if tried >= max_attempts:
                break
            if not engine.health.breaker.allow(time.monotonic()):
                result.attempts.append(Attempt(engine.id, "circuit open"))
                continue
            tried += 1
            engine.in_flight += 1
            generation = engine.load.poll_generation
            try:
                with tracing.upstream_span(engine.id, engine.url) as span:
                    outcome = await _try_engine(engine, exchange, result, start)
                    span.set_attribute("kvmesh.outcome", result.attempts[-1].outcome if result.attempts else "")
            finally:
                engine.in_flight -= 1
                if engine.load.poll_generation != generation:
                    engine.load.finished_since_poll += 1
            if outcome is True:
                result.total_s = time.perf_counter() - start
                _settle(candidates, ledger)
                return result
            if isinstance(outcome, ErrorAnswer):
                request_error = ledger.add(outcome)
                if request_error is not None:
                    _settle(candidates, ledger, request_at_fault=True)
                    raise UpstreamFailure.of(request_error, result.attempts)
    except _NoRetry as stop:
        _settle(candidates, ledger)
        raise UpstreamFailure.of(stop.error, result.attempts) from None
    _settle(candidates, ledger)
    busy = ledger.all_rate_limited(tried)
    if busy is not None:
        raise UpstreamFailure.of(busy, result.attempts)
    kinds = ", ".join(a.outcome.split(" (")[0] for a in result.attempts) or "no engine available"
    raise UpstreamFailure(503, f"no engine could serve the request ({kinds})", code="no_engine_available",
                          attempts=result.attempts)


def _settle(candidates: list[EngineState], ledger: ErrorLedger, request_at_fault: bool = False) -> None:
    """Charge the engines' error answers once the verdict is known: server errors count against their
    engines unless the request was at fault; anything else only frees the half-open probe slot it took
    (a busy engine, or one the request broke, has shown neither failure nor success)."""
    now = time.monotonic()
    engines = {e.id: e for e in candidates}
    for answer in ledger.answers:
        breaker = engines[answer.engine].health.breaker
        if answer.status >= 500 and not request_at_fault:
            breaker.record_failure(now, f"status {answer.status}")
        else:
            breaker.abstain(now)


async def _error_answer(engine: EngineState, upstream: UpstreamResponse, timeouts: Timeouts) -> ErrorAnswer:
    """The engine's error response, its body read (bounded) so the connection can be reused."""
    try:
        body = await upstream.read(min(timeouts.idle, ERROR_BODY_TIMEOUT_S), ERROR_BODY_LIMIT)
    except UpstreamError:
        body = b""
    return ErrorAnswer.parse(engine.id, upstream.status, body, upstream.header("retry-after"))


async def _try_engine(engine: EngineState, exchange: Exchange, result: ProxyResult,
                      start: float) -> bool | ErrorAnswer:
    """One attempt: True when the client got a response, the engine's answer when it was a retryable
    error status, False when the engine failed (already charged)."""
    try:
        headers = tracing.inject(exchange.headers)
        upstream = await engine.pool.request(exchange.method, exchange.target, exchange.body, headers,
                                             exchange.timeouts.connect, exchange.timeouts.first_byte,
                                             exchange.timeouts.send)
    except UpstreamTimeout as exc:
        if not exchange.is_stream:
            # vLLM answers a non-streamed request only when generation ends: the engine is still working
            # on it, so another engine would generate it again, and slowness is not a failure.
            engine.health.breaker.abstain(time.monotonic())
            result.attempts.append(Attempt(engine.id, "timeout (generation still running)"))
            raise _NoRetry(ApiError(504, f"no answer within {exchange.timeouts.first_byte:g}s",
                                    code="upstream_timeout")) from None
        engine.health.breaker.record_failure(time.monotonic(), "no response")
        result.attempts.append(Attempt(engine.id, f"unreachable ({exc})"))
        return False
    except UpstreamError as exc:
        engine.health.breaker.record_failure(time.monotonic(), "unreachable")
        result.attempts.append(Attempt(engine.id, f"unreachable ({exc})"))
        return False
    try:
        if upstream.status in RETRYABLE_STATUS:
            result.attempts.append(Attempt(engine.id, f"status {upstream.status}", upstream.status))
            return await _error_answer(engine, upstream, exchange.timeouts)
        try:
            first, rest = await _first_chunk(upstream, exchange.timeouts)
        except (UpstreamError, trio.TooSlowError) as exc:
            engine.health.breaker.record_failure(time.monotonic(), "no first byte")
            result.attempts.append(Attempt(engine.id, f"failed before first byte ({exc or 'timeout'})"))
            return False
        result.ttft_s = time.perf_counter() - start
        result.engine = engine
        result.status = upstream.status
        result.attempts.append(Attempt(engine.id, "ok", upstream.status))
        await exchange.send({"type": "http.response.start", "status": upstream.status,
                    "headers": _response_headers(upstream, exchange.route_header(engine, result.attempts))})
        if first is not None:
            _note_chunk(result, first)
            await exchange.send({"type": "http.response.body", "body": first, "more_body": True})
        try:
            async for chunk in rest:
                _note_chunk(result, chunk)
                await exchange.send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            engine.health.breaker.record_failure(time.monotonic(), "broken stream")
            result.broken_after_first_byte = True
            tail = sse_error_event(f"engine {engine.id} failed mid-stream: {exc}") if exchange.is_stream else b""
            await exchange.send({"type": "http.response.body", "body": tail, "more_body": False})
            return True
        engine.health.breaker.record_success(time.monotonic())
        await exchange.send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
    finally:
        await upstream.aclose()
