"""Forward one request to engines in ranked order, streaming the answer back as it arrives.

The client sees nothing until an engine has produced its first body chunk, so a failure before that
point (connect error, 5xx, 429, a stall before the first token) is retried on the next candidate, with
two exceptions. A server error that a second engine repeats is the request's fault: the client gets it
(``gateway.failover``). A non-streamed request whose engine took it but has not answered in time is not
sent elsewhere: vLLM answers it only when generation ends, so the engine is still working on it; the
client gets a 504 and no breaker moves. But a non-streamed request whose engine dies before the router
answered (the connection closed, or the answer broke off) is sent again in full to another engine; the
answer is read whole before the client gets any of it. Once two engines died on one request, streamed or
not, it goes to no third (``gateway.failover.QUERY_OF_DEATH_LOSSES``).
When every engine answers 429, so does the router.
After the first byte, a stream that breaks (engine gone, stalled, an SSE error event, drained) is
continued on the next engine in cost order and spliced into the client's (``gateway.continuation``),
at most ``ContinuationSpec.max_continuations`` times and not past the request timeout. Streams that
cannot be continued (n > 1, logprobs, echo, tools...) end with an SSE error event the OpenAI client raises.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from gateway import tracing
from gateway.breaker import CircuitBreaker
from gateway.continuation import ContinuationSpec, StreamSplicer, continuation_body, token_budget
from gateway.engines import EngineState, InFlight
from gateway.failover import QUERY_OF_DEATH_LOSSES, ErrorAnswer, ErrorLedger
from gateway.metrics import RouterMetrics
from gateway.openai_errors import ApiError, sse_error_event
from gateway.upstream import (
    POLL_BODY_LIMIT,
    SEND_TIMEOUT_S,
    UpstreamError,
    UpstreamLost,
    UpstreamResponse,
    UpstreamTimeout,
)

log = logging.getLogger("kvmesh.proxy")
Send = Callable[[dict[str, Any]], Awaitable[None]]
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_TAIL_BYTES = 4096
ERROR_BODY_LIMIT = 64 * 1024
ERROR_BODY_TIMEOUT_S = 5.0
NON_STREAMED_BUFFER = 16 * 1024 * 1024
LOST = "lost"
"""The outcome of an attempt whose engine took the request and died before answering it."""
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"})
_OWN_RESPONSE_HEADERS = frozenset({"server", "date"})
"""Set by the router's own HTTP server."""


@dataclass
class Timeouts:
    connect: float = 2.0
    first_byte: float = 120.0
    idle: float = 120.0
    send: float = SEND_TIMEOUT_S
    request: float = 600.0
    """No continuation is started, or waited for, past this many seconds after the request arrived."""


@dataclass
class Attempt:
    engine: str
    outcome: str
    status: int | None = None


@dataclass
class Continued:
    """One continuation of a broken stream: the engine that broke and why, the engine that went on
    (None when none could), tokens the client had before, and its wait from the break to the next token."""

    from_engine: str
    reason: str
    sent_tokens: int
    to_engine: str | None = None
    latency_s: float | None = None


def report_continued(metrics: RouterMetrics, request_id: str, continued: list[Continued], route: str) -> None:
    """Count a request's continuations and log them with the route of the final answer (its header was
    sent before the break, so this line is where the final explanation goes)."""
    for record in continued:
        metrics.continuations.labels("continued" if record.latency_s is not None else "failed").inc()
        if record.latency_s is not None:
            metrics.continuation_latency.observe(record.latency_s)
    log.info("continued", extra={"request_id": request_id, "continued_from": [c.from_engine for c in continued],
                                 "continued_to": [c.to_engine for c in continued],
                                 "reasons": [c.reason for c in continued],
                                 "sent_tokens": [c.sent_tokens for c in continued],
                                 "latency_ms": [None if c.latency_s is None else round(c.latency_s * 1000, 2)
                                                for c in continued], "route": route})


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
    continuations: list[Continued] = field(default_factory=list)
    first_token_out: Callable[[], None] = field(default=lambda: None, repr=False)
    """Called once the first token has gone to the client (see ``gateway.first_tokens``)."""
    claim: InFlight | None = field(default=None, repr=False)
    """The current attempt's share of its engine's ``in_flight`` (a continued stream gives it back early)."""

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


FIRST_TOKEN_EVENTS = 2
"""SSE events up to and with a stream's first token: a chat stream opens with an event that carries only
the role (a completion's second event is its second token: its ingest waits one token longer)."""


def _relayed(result: ProxyResult) -> None:
    """After a body chunk went to the client: once the first token has, the engine's events may be ingested."""
    if result.events >= FIRST_TOKEN_EVENTS:
        result.first_token_out()


async def _whole_answer(first: bytes, rest: Any) -> bytes:
    """A non-streamed answer read to its end (up to ``NON_STREAMED_BUFFER``) before the client gets any of
    it, so an engine that breaks it can be replaced; a bigger answer is passed on as it comes."""
    chunks, size = [first], len(first)
    while size < NON_STREAMED_BUFFER:
        try:
            chunk = await anext(rest)  # raises UpstreamError when the engine breaks or stalls
        except StopAsyncIteration:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


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
    continuation: ContinuationSpec | None = None
    """Set for a stream that may be continued on another engine when it breaks."""
    body_for: Callable[[EngineState], bytes] | None = None
    """The body of each attempt, when it depends on the engine and the moment (a decode leg carries the
    prefill's handoff only to its first engine, and only within the lease)."""
    headers_for: Callable[[EngineState, list[tuple[str, str]]], list[tuple[str, str]]] | None = None
    """The headers of each attempt from the exchange's, when they depend on the engine (a P/D leg pins the
    data-parallel rank of the engine it goes to); called after ``body_for``."""
    breaker: Callable[[EngineState], CircuitBreaker] | None = None
    """The breaker each attempt is checked against and charged to, when not the engine's own (a prefill leg
    on an engine that also decodes: its failures must not keep the engine from decoding)."""


def _breaker(exchange: Exchange, engine: EngineState) -> CircuitBreaker:
    return engine.health.breaker if exchange.breaker is None else exchange.breaker(engine)


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


Forward = Callable[[list[EngineState], Exchange, int], Awaitable[ProxyResult]]
"""What the router calls to proxy one request (``forward`` below; tests pass an in-process answerer)."""


async def forward(candidates: list[EngineState], exchange: Exchange, max_attempts: int) -> ProxyResult:
    """Try engines in ranked order; engines whose breaker is open are skipped without using an attempt.

    An engine's error answer is charged to it only once the request turns out not to be at fault (see
    ``gateway.failover``): a second identical one ends the request with the engine's own error."""
    exchange = replace(exchange, headers=_upstream_headers(exchange.headers))
    result = ProxyResult()
    ledger = ErrorLedger()
    start = trio.current_time()
    tried = lost = 0
    try:
        for engine in candidates:
            if tried >= max_attempts:
                break
            if not _breaker(exchange, engine).allow(trio.current_time()):
                result.attempts.append(Attempt(engine.id, "circuit open"))
                continue
            tried += 1
            result.claim = claim = InFlight(engine)
            try:
                with tracing.upstream_span(engine.id, engine.url) as span:
                    outcome = await _try_engine(engine, exchange, result, start, candidates)
                    span.set_attribute("kvmesh.outcome", result.attempts[-1].outcome if result.attempts else "")
            finally:
                claim.release()
            if outcome is False and result.attempts[-1].outcome.startswith(LOST):
                lost += 1
                if lost >= QUERY_OF_DEATH_LOSSES:
                    _settle(candidates, exchange, ledger)
                    raise UpstreamFailure(502, QUERY_OF_DEATH, code="engines_died_on_request",
                                          attempts=result.attempts)
            if outcome is True:
                result.total_s = trio.current_time() - start
                _settle(candidates, exchange, ledger)
                return result
            if isinstance(outcome, ErrorAnswer):
                request_error = ledger.add(outcome)
                if request_error is not None:
                    _settle(candidates, exchange, ledger, request_at_fault=True)
                    raise UpstreamFailure.of(request_error, result.attempts)
    except _NoRetry as stop:
        _settle(candidates, exchange, ledger)
        raise UpstreamFailure.of(stop.error, result.attempts) from None
    _settle(candidates, exchange, ledger)
    busy = ledger.all_rate_limited(tried)
    if busy is not None:
        raise UpstreamFailure.of(busy, result.attempts)
    kinds = ", ".join(a.outcome.split(" (")[0] for a in result.attempts) or "no engine available"
    raise UpstreamFailure(503, f"no engine could serve the request ({kinds})", code="no_engine_available",
                          attempts=result.attempts)


def _settle(candidates: list[EngineState], exchange: Exchange, ledger: ErrorLedger,
            request_at_fault: bool = False) -> None:
    """Charge the engines' error answers once the verdict is known: server errors count against their
    engines unless the request was at fault; anything else only frees the half-open probe slot it took
    (a busy engine, or one the request broke, has shown neither failure nor success)."""
    now = trio.current_time()
    engines = {e.id: e for e in candidates}
    for answer in ledger.answers:
        breaker = _breaker(exchange, engines[answer.engine])
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
                      start: float, candidates: list[EngineState]) -> bool | ErrorAnswer:
    """One attempt: True when the client got a response, the engine's answer when it was a retryable
    error status, False when the engine failed (already charged). While a stream waits for its first
    token, the engine's event ingest lets it go first (``gateway.first_tokens``)."""
    if not exchange.is_stream:
        return await _attempt(engine, exchange, result, start, candidates)
    result.first_token_out = engine.first_tokens.wait_for_one()
    try:
        return await _attempt(engine, exchange, result, start, candidates)
    finally:
        result.first_token_out()


async def _attempt(engine: EngineState, exchange: Exchange, result: ProxyResult,
                   start: float, candidates: list[EngineState]) -> bool | ErrorAnswer:
    try:
        body = exchange.body if exchange.body_for is None else exchange.body_for(engine)
        headers = tracing.inject(exchange.headers if exchange.headers_for is None
                                 else exchange.headers_for(engine, exchange.headers))
        upstream = await engine.pool.request(exchange.method, exchange.target, body, headers,
                                             exchange.timeouts.connect, exchange.timeouts.first_byte,
                                             exchange.timeouts.send)
    except UpstreamTimeout as exc:
        if not exchange.is_stream:
            # vLLM answers a non-streamed request only when generation ends: the engine is still working
            # on it, so another engine would generate it again, and slowness is not a failure.
            _breaker(exchange, engine).abstain(trio.current_time())
            result.attempts.append(Attempt(engine.id, "timeout (generation still running)"))
            raise _NoRetry(ApiError(504, f"no answer within {exchange.timeouts.first_byte:g}s",
                                    code="upstream_timeout")) from None
        _breaker(exchange, engine).record_failure(trio.current_time(), "no response")
        result.attempts.append(Attempt(engine.id, f"unreachable ({exc})"))
        return False
    except UpstreamLost as exc:
        _breaker(exchange, engine).record_failure(trio.current_time(), "lost")
        result.attempts.append(Attempt(engine.id, f"{LOST} ({exc})"))
        return False
    except UpstreamError as exc:
        _breaker(exchange, engine).record_failure(trio.current_time(), "unreachable")
        result.attempts.append(Attempt(engine.id, f"unreachable ({exc})"))
        return False
    try:
        if upstream.status in RETRYABLE_STATUS:
            result.attempts.append(Attempt(engine.id, f"status {upstream.status}", upstream.status))
            return await _error_answer(engine, upstream, exchange.timeouts)
        try:
            first, rest = await _first_chunk(upstream, exchange.timeouts)
        except (UpstreamError, trio.TooSlowError) as exc:
            _breaker(exchange, engine).record_failure(trio.current_time(), "no first byte")
            result.attempts.append(Attempt(engine.id, f"failed before first byte ({exc or 'timeout'})"))
            return False
        if not exchange.is_stream and first is not None:
            try:
                first = await _whole_answer(first, rest)
            except UpstreamError as exc:
                _breaker(exchange, engine).record_failure(trio.current_time(), "broken answer")
                result.attempts.append(Attempt(engine.id, f"{LOST} mid-answer ({exc})"))
                return False
        result.ttft_s = trio.current_time() - start
        result.engine = engine
        result.status = upstream.status
        result.attempts.append(Attempt(engine.id, "ok", upstream.status))
        await exchange.send({"type": "http.response.start", "status": upstream.status,
                    "headers": _response_headers(upstream, exchange.route_header(engine, result.attempts))})
        if exchange.continuation is not None and upstream.status == 200:
            deadline = trio.current_time() + exchange.timeouts.request - (trio.current_time() - start)
            await _Relay(exchange, exchange.continuation, result, candidates, deadline).run(engine, upstream, first,
                                                                                            rest)
            return True
        if first is not None:
            _note_chunk(result, first)
            await exchange.send({"type": "http.response.body", "body": first, "more_body": True})
            _relayed(result)
        try:
            async for chunk in rest:
                _note_chunk(result, chunk)
                await exchange.send({"type": "http.response.body", "body": chunk, "more_body": True})
                _relayed(result)
        except UpstreamError as exc:
            _breaker(exchange, engine).record_failure(trio.current_time(), "broken stream")
            result.broken_after_first_byte = True
            tail = sse_error_event(f"engine {engine.id} failed mid-stream: {exc}") if exchange.is_stream else b""
            await exchange.send({"type": "http.response.body", "body": tail, "more_body": False})
            return True
        _breaker(exchange, engine).record_success(trio.current_time())
        await exchange.send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
    finally:
        await upstream.aclose()


DRAINED = "drained"
ENGINE_ERROR = "engine error event"
QUERY_OF_DEATH = (f"{QUERY_OF_DEATH_LOSSES} engines died while generating this request; it is not sent to "
                  "another one")
_TOKENIZE_KEYS = ("model", "messages", "prompt", "add_generation_prompt", "continue_final_message",
                  "add_special_tokens", "chat_template_kwargs", "tools", "documents", "cache_salt")
"""The fields of vLLM's tokenize requests a chat or completion body shares with them."""


class _Relay:
    """A continuable stream on its way to the client, engine after engine (see ``gateway.continuation``)."""

    def __init__(self, exchange: Exchange, spec: ContinuationSpec, result: ProxyResult,
                 candidates: list[EngineState], deadline: float) -> None:
        self.exchange = exchange
        self.spec = spec
        self.result = result
        self.candidates = candidates
        self.deadline = deadline
        self.splicer = StreamSplicer(spec.kind, spec.include_usage, spec.prompt_tokens)
        self.failed = {a.engine for a in result.attempts if a.outcome != "ok"}
        self.deaths = sum(1 for a in result.attempts if a.outcome.startswith(LOST))
        """Engines that died on this request so far (see ``QUERY_OF_DEATH_LOSSES``)."""
        self._waiting: tuple[Continued, float] | None = None
        """The continuation whose first token has not reached the client yet, and when its stream broke."""

    async def run(self, engine: EngineState, upstream: UpstreamResponse, first: bytes | None, body: Any) -> None:
        """Relay ``upstream`` (the first leg, its share of ``in_flight`` in ``result.claim``) and whatever
        continues it. Each leg's stream is closed and its share given back as soon as it breaks, so a drained
        or failing engine stops generating (vLLM aborts a request whose connection closed)."""
        claim = self.result.claim
        assert claim is not None
        try:
            while True:
                why = await self._pump(engine, first, body)
                if why is None:
                    engine.health.breaker.record_success(trio.current_time())
                    await self._finish(self.splicer.ending(None))
                    return
                claim.release()
                await upstream.aclose()
                self._broken(engine, why)
                text = self.splicer.generated
                refusal = self._refusal(engine, why, text)
                if refusal is not None:
                    await self._finish(refusal)
                    return
                assert text is not None
                sent = await self._count_sent(text)
                request = continuation_body(self.spec.body, self.spec.kind, text, sent)
                if request is None:
                    await self._finish(self.splicer.ending("length"))
                    return
                record = Continued(engine.id, why, sent)
                self.result.continuations.append(record)
                self._waiting = (record, trio.current_time())
                opened = await self._open(json.dumps(request).encode())
                if opened is None:
                    await self._finish(sse_error_event(f"engine {engine.id} failed mid-stream ({why}) and no "
                                                       "engine could continue the answer"))
                    return
                engine, upstream, claim, first, body = opened
                record.to_engine = engine.id
                await self._count_prompt(engine)
                self.splicer.begin_continuation()
        finally:
            claim.release()
            await upstream.aclose()

    async def _pump(self, engine: EngineState, first: bytes | None, body: Any) -> str | None:
        """Forward one engine's stream; None when it ended cleanly, else why it broke."""
        if first is not None and await self._emit(first):
            return f"{ENGINE_ERROR}: {self.splicer.engine_error}"
        while True:
            try:
                if engine.draining:
                    with trio.move_on_at(engine.pool.drain_at) as drain:
                        chunk = await anext(body)
                    if drain.cancelled_caught:
                        return DRAINED
                else:  # no cancel scope per chunk: the common case stays a few microseconds cheaper
                    chunk = await anext(body)
            except StopAsyncIteration:
                return None if self.splicer.done or self.splicer.finished else "stream ended early"
            except UpstreamError as exc:
                return str(exc)
            if await self._emit(chunk):
                return f"{ENGINE_ERROR}: {self.splicer.engine_error}"

    async def _emit(self, chunk: bytes) -> bool:
        """Send what the splicer makes of ``chunk``; True when the engine reported an error instead."""
        _note_chunk(self.result, chunk)
        out = self.splicer.feed(chunk)
        if out:
            if self._waiting is not None:
                record, broke_at = self._waiting
                record.latency_s = trio.current_time() - broke_at
                self._waiting = None
            await self.exchange.send({"type": "http.response.body", "body": out, "more_body": True})
            _relayed(self.result)
        return self.splicer.engine_error is not None

    def _broken(self, engine: EngineState, why: str) -> None:
        """Charge the engine (a drained one did nothing wrong) and note the break."""
        if why == DRAINED:
            self.result.attempts.append(Attempt(engine.id, "drained mid-stream"))
        else:
            engine.health.breaker.record_failure(trio.current_time(), "broken stream")
            self.result.attempts.append(Attempt(engine.id, f"broken mid-stream ({why})"))
            if not why.startswith(ENGINE_ERROR):  # it went away or stalled: it did not survive the request
                self.deaths += 1
        self.result.broken_after_first_byte = True
        self.failed.add(engine.id)

    def _refusal(self, engine: EngineState, why: str, text: str | None) -> bytes | None:
        """How the stream ends when it is not continued; None when it may be."""
        splicer = self.splicer
        if splicer.finished:
            return splicer.ending(None)  # only the usage chunk or [DONE] were missing
        reason = (splicer.unsplicable
                  or ("the engine's text so far is not valid JSON" if text is None else None)
                  or (QUERY_OF_DEATH if self.deaths >= QUERY_OF_DEATH_LOSSES else None)
                  or ("continuation limit reached" if len(self.result.continuations) >= self.spec.max_continuations
                      else None)
                  or ("request timeout reached" if trio.current_time() >= self.deadline else None))
        if reason is None:
            return None
        return sse_error_event(f"engine {engine.id} failed mid-stream ({why}); not continued: {reason}")

    async def _finish(self, tail: bytes) -> None:
        await self.exchange.send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _count_prompt(self, engine: EngineState) -> None:
        """The original prompt's size by the engine's own ``/tokenize``, for the usage chunk, when the
        router did not count it (a policy that does not tokenize). Without it the usage chunk estimates
        the prompt as the continuation's less the tokens sent before."""
        if self.splicer.prompt_tokens is not None or not self.spec.include_usage:
            return
        count = await self._tokenize(engine, {k: v for k, v in self.spec.body.items() if k in _TOKENIZE_KEYS})
        if count:
            self.splicer.prompt_tokens = count

    async def _count_sent(self, text: str) -> int:
        """Tokens the client has received, for the next engine's budget and the usage chunk: an SSE event may
        carry several tokens (speculative decoding, vLLM's stream interval), so the text is counted by the
        next engine's own ``/tokenize``. The events that carried text stay a floor (a text may re-tokenize
        into fewer tokens than were generated), and are all there is when no engine counts it."""
        engine = next((e for e in self.candidates if self._may_continue(e)), None)
        if engine is not None and text:
            count = await self._tokenize(engine, {"model": self.spec.body.get("model"), "prompt": text,
                                                  "add_special_tokens": False})
            budget = token_budget(self.spec.body)
            if count is not None and budget is not None and self.splicer.tokens < budget:
                # The engine stopped short of the budget (the stream broke before its finish), but a text can
                # re-tokenize into more tokens than were generated: such a count would end the answer early
                # and report more tokens than max_tokens allows. One token is left to the next engine.
                count = min(count, budget - 1)
            self.splicer.tokens = max(self.splicer.tokens, count or 0)
        return self.splicer.tokens

    async def _tokenize(self, engine: EngineState, request: dict[str, Any]) -> int | None:
        """The ``count`` of the engine's ``/tokenize`` answer to ``request``; None when it gives none."""
        timeouts = self.exchange.timeouts
        try:
            with trio.fail_after(min(timeouts.first_byte, ERROR_BODY_TIMEOUT_S)):
                response = await engine.pool.request("POST", "/tokenize", json.dumps(request).encode(),
                                                     [("content-type", "application/json")], timeouts.connect)
                try:
                    count = json.loads(await response.read(timeouts.idle, POLL_BODY_LIMIT)).get("count")
                finally:
                    await response.aclose()
        except (UpstreamError, trio.TooSlowError, ValueError, AttributeError, RecursionError):
            return None
        ok = response.status == 200 and type(count) is int and 0 <= count < 2**31
        return count if ok else None

    def _may_continue(self, engine: EngineState) -> bool:
        return not (engine.id in self.failed or engine.draining or engine.maintenance
                    or not engine.health.breaker.allow(trio.current_time()))

    async def _open(self, body: bytes) -> tuple[EngineState, UpstreamResponse, InFlight, bytes | None, Any] | None:
        """The continuation's first chunk from the next engine in cost order that gives one in time. An
        engine's share of ``in_flight`` and its connection are given back whatever ends the attempt, the
        client leaving (a cancellation) included; only a stream handed to the caller keeps them."""
        timeouts = self.exchange.timeouts
        for engine in self.candidates:
            if self.deaths >= QUERY_OF_DEATH_LOSSES:
                break
            if not self._may_continue(engine):
                continue
            claim = InFlight(engine)
            upstream = None
            handed_over = False
            try:
                with trio.move_on_at(self.deadline):
                    try:
                        upstream = await engine.pool.request("POST", self.exchange.target, body,
                                                             tracing.inject(self.exchange.headers),
                                                             timeouts.connect, timeouts.first_byte, timeouts.send)
                        if upstream.status == 200:
                            first, rest = await _first_chunk(upstream, timeouts)
                            self.result.attempts.append(Attempt(engine.id, "ok", 200))
                            handed_over = True
                            return engine, upstream, claim, first, rest
                        answer = await _error_answer(engine, upstream, timeouts)
                        self.result.attempts.append(Attempt(engine.id, f"status {answer.status}", answer.status))
                        if answer.status >= 500:
                            engine.health.breaker.record_failure(trio.current_time(), f"status {answer.status}")
                        else:
                            engine.health.breaker.abstain(trio.current_time())
                    except (UpstreamError, trio.TooSlowError) as exc:
                        engine.health.breaker.record_failure(trio.current_time(), "continuation failed")
                        lost = isinstance(exc, UpstreamLost)
                        self.deaths += lost
                        self.result.attempts.append(Attempt(engine.id, f"{LOST if lost else 'unreachable'} "
                                                                       f"({exc or 'timeout'})"))
            finally:
                if not handed_over:
                    claim.release()
                    if upstream is not None:
                        await upstream.aclose()
            self.failed.add(engine.id)
        return None
