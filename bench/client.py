"""A lean HTTP/1.1 client (h11 over trio streams) and the closed- and open-loop load drivers.

httpx costs about 1 ms of CPU per request on this kind of machine, which would make the load
generator the bottleneck; a keep-alive pool of h11 connections keeps the client's share small.
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11
import trio

from bench.sse import SseSplitter, StreamedAnswer, usage_counts
from bench.stats import RequestResult
from bench.workloads import Conversation

ROUTE_HEADER = "x-kvmesh-route"
TRANSPORT_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError, OSError)


class _Connection:
    """One keep-alive socket and its h11 state machine."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(our_role=h11.CLIENT)

    async def send(self, event: h11.Event) -> None:
        data = self.h11.send(event)
        if data:
            await self.stream.send_all(data)

    async def next_event(self) -> h11.Event:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.stream.receive_some(65536))

    @property
    def reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = b""


BodySink = Callable[[bytes], None]


@dataclass
class HttpClient:
    """Keep-alive pool per host:port. One instance per trio run; not shared across threads."""

    max_idle_per_host: int = 256
    _idle: dict[tuple[str, int], deque[_Connection]] = field(default_factory=lambda: defaultdict(deque))

    async def request(
        self, url: str, method: str = "GET", body: bytes | None = None, sink: BodySink | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> Response:
        """Send one request; body chunks go to ``sink`` as they arrive (else into ``Response.body``).
        ``headers`` are sent beside the client's own (an ``authorization`` key, say).

        A pooled connection the server already closed is retried once on a fresh one, but only if
        nothing of the response was received yet.
        """
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sent = [("host", f"{host}:{port}"), ("accept", "*/*"), *headers]
        if body is not None:
            sent += [("content-type", "application/json"), ("content-length", str(len(body)))]
        request = h11.Request(method=method, target=target, headers=sent)
        for attempt in range(2):
            conn, reused = await self._checkout(host, port, fresh=attempt > 0)
            try:
                await conn.send(request)
                if body is not None:
                    await conn.send(h11.Data(data=body))
                await conn.send(h11.EndOfMessage())
                head = await conn.next_event()
            except TRANSPORT_ERRORS:
                await conn.stream.aclose()
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                await trio.aclose_forcefully(conn.stream)
                raise
            return await self._read_response(conn, (host, port), head, sink)
        raise AssertionError("unreachable: the second attempt either returns or raises")

    async def _checkout(self, host: str, port: int, fresh: bool = False) -> tuple[_Connection, bool]:
        """A pooled connection, else a new one; ``fresh`` skips the pool, whose other connections may have
        died with the same peer (behind an L4 balancer, with the same killed replica)."""
        idle = self._idle[(host, port)]
        if idle and not fresh:
            return idle.pop(), True
        return _Connection(await trio.open_tcp_stream(host, port)), False

    async def _read_response(
        self, conn: _Connection, key: tuple[str, int], head: h11.Event, sink: BodySink | None
    ) -> Response:
        try:
            if not isinstance(head, h11.Response):
                raise h11.RemoteProtocolError(f"expected a response head, got {type(head).__name__}")
            response = Response(head.status_code, {k.decode(): v.decode("latin-1") for k, v in head.headers})
            chunks: list[bytes] = []
            while True:
                event = await conn.next_event()
                if isinstance(event, h11.Data):
                    (sink or chunks.append)(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
            response.body = b"".join(chunks)
        except BaseException:
            await trio.aclose_forcefully(conn.stream)
            raise
        if conn.reusable and len(self._idle[key]) < self.max_idle_per_host:
            conn.h11.start_next_cycle()
            self._idle[key].append(conn)
        else:
            await conn.stream.aclose()
        return response

    async def get_json(self, url: str, timeout: float = 5.0, headers: Sequence[tuple[str, str]] = ()) -> object:
        with trio.fail_after(timeout):
            response = await self.request(url, headers=headers)
        if response.status != 200:
            raise OSError(f"GET {url} answered {response.status}")
        return json.loads(response.body)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            while idle:
                await trio.aclose_forcefully(idle.pop().stream)


async def completion(
    client: HttpClient,
    url: str,
    body: dict,
    timeout: float = 60.0,
    route_header: str = ROUTE_HEADER,
    started: float = 0.0,
) -> RequestResult:
    """POST one OpenAI request and measure it; failures are recorded in the result, never raised.

    Streaming: TTFT is the time to the first event carrying generated text. Non-streaming: there is
    no first token to see, so TTFT stays unset and only the total latency counts.
    """
    result = RequestResult(started=started)
    answer = StreamedAnswer()
    splitter = SseSplitter()
    t0 = trio.current_time()

    def on_chunk(chunk: bytes) -> None:
        for payload in splitter.feed(chunk):
            if answer.apply(payload) and result.ttft is None:
                result.ttft = trio.current_time() - t0

    stream = bool(body.get("stream"))
    with trio.move_on_after(timeout) as scope:
        try:
            response = await client.request(
                url, "POST", json.dumps(body).encode(), on_chunk if stream else None
            )
        except (*TRANSPORT_ERRORS, trio.TooSlowError) as exc:
            result.error = f"{type(exc).__name__}"
            result.total = trio.current_time() - t0
            return result
    result.total = trio.current_time() - t0
    if scope.cancelled_caught:
        result.error = "timeout"
        return result
    result.status = response.status
    result.route = response.headers.get(route_header, "")
    if stream:
        _finish_stream(result, answer)
    elif response.status == 200:
        _finish_plain(result, response.body)
    return result


def _finish_stream(result: RequestResult, answer: StreamedAnswer) -> None:
    result.content = answer.text
    result.output_tokens = answer.output_tokens
    result.prompt_tokens, result.cached_tokens = answer.prompt_tokens, answer.cached_tokens
    if result.status == 200 and answer.error:
        result.error = "error event"
    elif result.status == 200 and not answer.done:
        result.error = "stream ended early"


def _finish_plain(result: RequestResult, raw: bytes) -> None:
    try:
        data = json.loads(raw)
        choice = data["choices"][0]
        result.content = choice["message"]["content"] if "message" in choice else choice["text"]
        completion_tokens, result.prompt_tokens, result.cached_tokens = usage_counts(data.get("usage") or {})
        result.output_tokens = completion_tokens or 0
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        result.error = "malformed body"


MODELS_WAIT_S = 10.0


async def model_name(client: HttpClient, base_url: str, wait_s: float = MODELS_WAIT_S) -> str:
    """The first model an OpenAI server lists; requests must name it. A router answering ``/health`` may list none
    until it has read its engines' (3 of 12 runs of a test starting a fresh router failed so), so an empty list
    is asked again for up to ``wait_s``."""
    with trio.move_on_after(wait_s):
        while True:
            listing = await client.get_json(base_url.rstrip("/") + "/v1/models")
            if listing.get("data"):  # type: ignore[union-attr]
                return listing["data"][0]["id"]  # type: ignore[index]
            await trio.sleep(0.05)
    raise ValueError(f"{base_url} listed no model within {wait_s:g} s")


CHAT_PATH = "/v1/chat/completions"


class Balancer:
    """Router replicas taking requests in turn, as an L4 balancer's round robin does (sans-IO).

    A replica taken out (``take_out``: it was killed) gets no further request. With ``kill_after``, the pick
    after that many picks first takes out the last replica and calls ``on_kill`` with its base URL: a replica
    dies partway through a run, at the same point of the trace for every entry that kills."""

    def __init__(self, bases: str | Sequence[str], kill_after: int | None = None,
                 on_kill: Callable[[str], None] | None = None) -> None:
        listed = [bases] if isinstance(bases, str) else list(bases)
        if not listed:
            raise ValueError("a balancer needs at least one replica")
        if kill_after is not None and len(listed) < 2:
            raise ValueError("killing a replica needs a survivor")
        self.bases = [b.rstrip("/") for b in listed]
        self.live = list(self.bases)
        self.picks = 0
        self.kill_after = kill_after
        self.on_kill = on_kill
        self.killed_at: int | None = None
        """Picks made before the kill (None: no replica was killed)."""
        self._turn = 0

    def take_out(self, base: str) -> None:
        base = base.rstrip("/")
        if base in self.live:
            self.live.remove(base)

    def is_live(self, chat_url: str) -> bool:
        return chat_url.removesuffix(CHAT_PATH) in self.live

    def next(self) -> str:
        """The chat URL of the next live replica."""
        if self.kill_after is not None and self.killed_at is None and self.picks >= self.kill_after:
            victim = self.bases[-1]
            self.take_out(victim)
            self.killed_at = self.picks
            if self.on_kill is not None:
                self.on_kill(victim)
        self.picks += 1
        base = self.live[self._turn % len(self.live)]
        self._turn += 1
        return base + CHAT_PATH


async def _session_turn(
    client: HttpClient, balancer: Balancer, conv: Conversation, model: str, stream: bool, timeout: float,
    route_header: str, t0: float,
) -> RequestResult:
    """Send a conversation's next turn and record its answer in the history (results keep key and turn).

    A turn that failed because its replica was killed under it is sent again to a live one, as a client
    retries a broken connection; its TTFT and total count the failed attempt too."""
    url = balancer.next()
    result = await completion(client, url, conv.body(model, stream), timeout, route_header, trio.current_time() - t0)
    if result.error and not balancer.is_live(url):
        lost, started = result.total, result.started
        result = await completion(client, balancer.next(), conv.body(model, stream), timeout, route_header, started)
        result.retried = True
        result.total += lost
        if result.ttft is not None:
            result.ttft += lost
    result.key, result.turn = conv.key, conv.sent
    conv.record_answer(result.content)
    return result


def _balancer(base_url: str | Sequence[str] | Balancer) -> Balancer:
    """Several base URLs (router replicas) take requests in turn, as a client-side round robin would."""
    return base_url if isinstance(base_url, Balancer) else Balancer(base_url)


async def run_closed_loop(
    client: HttpClient,
    base_url: str | Sequence[str] | Balancer,
    conversations: list[Conversation],
    concurrency: int,
    model: str,
    stream: bool = True,
    timeout: float = 60.0,
    route_header: str = ROUTE_HEADER,
) -> tuple[list[RequestResult], float]:
    """``concurrency`` workers each send their next request as soon as the previous one ends.

    Conversations rotate through one queue so a chat's turns stay in order while others interleave.
    Returns the results and the wall time.
    """
    balancer = _balancer(base_url)
    pending = deque(conversations)
    results: list[RequestResult] = []
    t0 = trio.current_time()

    async def worker() -> None:
        while pending:
            conv = pending.popleft()
            results.append(await _session_turn(client, balancer, conv, model, stream, timeout, route_header, t0))
            if not conv.done:
                pending.append(conv)

    async with trio.open_nursery() as nursery:
        for _ in range(max(1, concurrency)):
            nursery.start_soon(worker)
    return results, trio.current_time() - t0


async def run_sessions(
    client: HttpClient,
    base_url: str | Sequence[str] | Balancer,
    conversations: list[Conversation],
    rate: float,
    model: str,
    rng: random.Random,
    stream: bool = True,
    timeout: float = 60.0,
    route_header: str = ROUTE_HEADER,
) -> tuple[list[RequestResult], float]:
    """Open loop: conversations arrive by a Poisson process of ``rate`` per second, whatever the server does,
    and each sends its turns one after the other (a user or an agent waits for each answer). Returns the
    results and the wall time."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    balancer = _balancer(base_url)
    results: list[RequestResult] = []
    t0 = trio.current_time()

    async def session(conv: Conversation) -> None:
        while not conv.done:
            results.append(await _session_turn(client, balancer, conv, model, stream, timeout, route_header, t0))

    async with trio.open_nursery() as nursery:
        arrival = t0
        for conv in conversations:
            await trio.sleep_until(arrival)
            nursery.start_soon(session, conv)
            arrival += rng.expovariate(rate)
    return results, trio.current_time() - t0


@dataclass
class OpenLoopReport:
    """Requests started at a fixed rate; ``skipped`` counts starts refused at the in-flight cap."""

    results: list[RequestResult]
    skipped: int
    wall: float


async def run_open_loop(
    send: Callable[[int, float], Awaitable[RequestResult]],
    rate: float,
    duration: float,
    max_in_flight: int = 256,
) -> OpenLoopReport:
    """Start request ``i`` at ``i / rate`` seconds whatever the server does, for ``duration`` seconds.

    ``send(i, started)`` performs one request. Arrival does not wait for service, so overload shows
    as latency and errors; the in-flight cap bounds memory when the server stops answering.
    """
    if rate <= 0 or duration <= 0:
        raise ValueError("rate and duration must be positive")
    results: list[RequestResult] = []
    in_flight = 0
    skipped = 0
    t0 = trio.current_time()

    async def one(i: int, started: float) -> None:
        nonlocal in_flight
        try:
            results.append(await send(i, started))
        finally:
            in_flight -= 1

    async with trio.open_nursery() as nursery:
        for i in range(math.floor(rate * duration)):
            await trio.sleep_until(t0 + i / rate)
            if in_flight >= max_in_flight:
                skipped += 1
                continue
            in_flight += 1
            nursery.start_soon(one, i, trio.current_time() - t0)
    return OpenLoopReport(results, skipped, trio.current_time() - t0)
