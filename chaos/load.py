"""Steady open-loop load through the cluster's balancer, with one ``RequestRecord`` per request.

The workload is deterministic per request index: most requests share one of a few long system prompts
(so the fleet has a hit rate to lose and win back), every fifth is unique (so a cold engine is always
worth sending something to), and every fourth is not streamed (both response paths are exercised).
The flood is one tenant's long prompts: a shared system prompt, then a fresh part longer than the router
encodes on its event loop (it goes to the tokenizer workers, after routing).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence

import trio

from bench.client import ROUTE_HEADER, TRANSPORT_ERRORS, HttpClient, run_open_loop
from bench.sse import SseSplitter, StreamedAnswer
from bench.stats import RequestResult
from bench.workloads import chat_body, text
from chaos import records as rec
from chaos.invariants import route_engine
from chaos.records import RequestRecord

Clock = Callable[[], float]
FLOOD_WORDS = 17_000
"""Words of a flood prompt's fresh part: about 100 KiB, over the 96 KiB above which the router encodes a
prompt in its tokenizer workers, and about 17k tokens (a simulated engine's cache holds three or four)."""


class ChaosWorkload:
    """Request bodies by index; ``systems`` shared prompts of ``system_tokens`` tokens each."""

    def __init__(self, model: str, seed: int = 0, systems: int = 6, system_tokens: int = 300,
                 max_tokens: int = 8, streamed_only: bool = False) -> None:
        rng = random.Random(f"chaos-{seed}")
        self.model = model
        self.seed = seed
        self.max_tokens = max_tokens
        self.streamed_only = streamed_only
        """Every request streamed, and its usage must count ``max_tokens`` (simulated engines)."""
        self.systems = [f"System {s}:" + text(rng, system_tokens) for s in range(systems)]

    def body(self, i: int) -> dict:
        rng = random.Random(f"chaos-{self.seed}-{i}")
        stream = self.streamed_only or i % 4 != 3
        if i % 5 == 4:
            messages = [{"role": "user", "content": f"Note {self.seed}-{i}:" + text(rng, 60)}]
        else:
            messages = [{"role": "system", "content": rng.choice(self.systems)},
                        {"role": "user", "content": text(rng, rng.randint(10, 40))}]
        return chat_body(messages, self.model, self.max_tokens, stream)


class FloodWorkload:
    """One tenant's long prompts: each a shared system prompt and ``words`` fresh words, 8 tokens answered."""

    def __init__(self, model: str, seed: int = 0, words: int = FLOOD_WORDS) -> None:
        self.model = model
        self.seed = seed
        self.words = words
        self.max_tokens = 8
        self.streamed_only = True
        self.system = "Flood system:" + text(random.Random(f"flood-{seed}"), 300)

    def body(self, i: int) -> dict:
        fresh = text(random.Random(f"flood-{self.seed}-{i}"), self.words)
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": f"Flood {i}:" + fresh}]
        return chat_body(messages, self.model, self.max_tokens, True)


async def measure(client: HttpClient, url: str, body: dict, index: int, clock: Clock,
                  timeout: float = 30.0, expect_tokens: int | None = None, tenant: str = "",
                  headers: Sequence[tuple[str, str]] = ()) -> RequestRecord:
    """Send one request and record what happened; never raises for a failure of the cluster.
    ``expect_tokens``: a stream's usage must count exactly that many (engines that always generate
    ``max_tokens``, as the simulated ones do). ``headers`` carry ``tenant``'s key."""
    stream = bool(body.get("stream"))
    record = RequestRecord(index, clock(), stream=stream, tenant=tenant)
    splitter, answer = SseSplitter(), StreamedAnswer()
    chunks: list[bytes] = []

    def sink(chunk: bytes) -> None:
        if record.first_byte is None:
            record.first_byte = clock()
        chunks.append(chunk)
        for payload in splitter.feed(chunk) if stream else ():
            chunks_before = answer.content_chunks
            if answer.apply(payload) and record.first_token is None:
                record.first_token = clock()
            if answer.content_chunks > chunks_before:
                record.token_times.append(clock())

    response = None
    with trio.move_on_after(timeout) as scope:
        try:
            response = await client.request(url, "POST", json.dumps(body).encode(), sink, headers)
        except TRANSPORT_ERRORS as exc:
            record.error, record.detail = rec.TRANSPORT, f"{type(exc).__name__}: {exc}"[:200]
    record.end = clock()
    if scope.cancelled_caught:
        record.error = rec.TIMEOUT
    if response is None:
        return record
    record.status = response.status
    record.engine = route_engine(response.headers.get(ROUTE_HEADER, ""))
    raw = b"".join(chunks)
    if response.status != 200:
        record.detail = raw[:200].decode("utf-8", errors="replace")
    elif stream and answer.error:
        record.error, record.detail = rec.SSE_ERROR, answer.error
    elif stream and not answer.done:
        record.error = rec.INCOMPLETE
    elif stream and expect_tokens is not None and answer.output_tokens != expect_tokens:
        record.error, record.detail = rec.SHORT, f"usage counts {answer.output_tokens} of {expect_tokens} tokens"
    elif not stream:
        record.error = "" if _complete_json(raw) else rec.MALFORMED
    return record


def _complete_json(raw: bytes) -> bool:
    try:
        return bool(json.loads(raw)["choices"])
    except (ValueError, KeyError, TypeError):
        return False


class LoadGenerator:
    """Open-loop load whose records survive cancellation: the runner stops it once the faults are over.

    Requests still in flight when it is cancelled are not recorded (they never finished). On a cluster
    with auth every request carries ``tenant``'s ``key``.
    """

    def __init__(self, client: HttpClient, url: str, workload: ChaosWorkload | FloodWorkload, clock: Clock,
                 timeout: float = 30.0, tenant: str = "", key: str = "") -> None:
        self.client = client
        self.endpoint = url.rstrip("/") + "/v1/chat/completions"
        self.workload = workload
        self.clock = clock
        self.timeout = timeout
        self.tenant = tenant
        self.headers = [("authorization", f"Bearer {key}")] if key else []
        self.records: list[RequestRecord] = []
        self.started = 0
        self._began = 0.0
        self._rate = 0.0
        self._planned = 0

    async def run(self, rate: float, duration: float, max_in_flight: int = 256) -> None:
        self._began, self._rate, self._planned = self.clock(), rate, math.floor(rate * duration)
        await run_open_loop(self._send, rate, duration, max_in_flight)

    def skipped(self, now: float) -> int:
        """Starts refused at the in-flight cap so far (those due minus those sent)."""
        if not self._rate:
            return 0
        due = min(self._planned, math.floor(self._rate * (now - self._began)) + 1)
        return max(0, due - self.started)

    async def _send(self, i: int, _started: float) -> RequestResult:
        self.started += 1
        expect = self.workload.max_tokens if self.workload.streamed_only else None
        record = await measure(self.client, self.endpoint, self.workload.body(i), i, self.clock, self.timeout,
                               expect, self.tenant, self.headers)
        self.records.append(record)
        return record.as_result()
