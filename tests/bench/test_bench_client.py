"""The h11 client and the load drivers against a real trio/h11 server on loopback."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import h11
import pytest
import trio

from bench import engine_stats
from bench.client import (
    Balancer,
    HttpClient,
    completion,
    model_name,
    run_closed_loop,
    run_open_loop,
    run_sessions,
)
from bench.stats import RequestResult
from bench.workloads import multi_turn, unique_prompts


@dataclass
class FakeOpenAI:
    """A tiny OpenAI-shaped server: streams words back, names a route, counts connections."""

    connections: int = 0
    requests: list[dict] = field(default_factory=list)
    hold_first_token: trio.Event | None = None
    one_request_per_connection: bool = False
    """Close each connection after its first answer, which still offers keep-alive (a peer that died)."""

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(our_role=h11.SERVER)
        try:
            while True:
                request, body = await self._read_request(conn, stream)
                if request is None:
                    return
                await self._answer(conn, stream, request, body)
                if self.one_request_per_connection:
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, h11.RemoteProtocolError):
            return
        finally:
            await stream.aclose()

    async def _read_request(self, conn, stream):
        request, body = None, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(data)
                if not data and request is None:
                    return None, b""
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, body
            else:
                return None, b""

    async def _send(self, conn, stream, status, headers, chunks):
        await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
        for chunk in chunks:
            if isinstance(chunk, trio.Event):
                await chunk.wait()
                continue
            await stream.send_all(conn.send(h11.Data(data=chunk)))
        await stream.send_all(conn.send(h11.EndOfMessage()))

    async def _answer(self, conn, stream, request, raw):
        path = request.target.decode()
        if path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()
            return await self._send(conn, stream, 200, [("content-length", str(len(body)))], [body])
        if path == "/metrics":
            body = f"vllm:prefix_cache_queries_total 100.0\nvllm:prefix_cache_hits_total {len(self.requests)}.0\n"
            return await self._send(conn, stream, 200, [("content-length", str(len(body)))], [body.encode()])
        try:
            body = json.loads(raw)
        except ValueError:
            return await self._send(conn, stream, 400, [("content-length", "0")], [])
        self.requests.append(body)
        route = [("x-kvmesh-route", f"engine-{len(self.requests) % 2}")]
        if body.get("model") == "broken":
            chunks = [b"data: {oops\n\n", b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n']
            return await self._send(conn, stream, 200, [*route, ("transfer-encoding", "chunked")], chunks)
        if not body.get("stream"):
            out = {"choices": [{"message": {"content": "a b"}}], "usage": {"completion_tokens": 2}}
            data = json.dumps(out).encode()
            return await self._send(conn, stream, 200, [*route, ("content-length", str(len(data)))], [data])
        chunks: list = [b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n']
        if self.hold_first_token is not None:
            chunks.append(self.hold_first_token)
        words = [f"w{len(self.requests)}", " two", " three"]
        chunks += [f"data: {json.dumps({'choices': [{'delta': {'content': w}}]})}\r\n\r\n".encode() for w in words]
        usage = {"completion_tokens": 3, "prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
        chunks.append(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await self._send(conn, stream, 200, [*route, ("transfer-encoding", "chunked")], chunks)


@pytest.fixture
async def server(nursery):
    fake = FakeOpenAI()
    listeners = await nursery.start(partial(trio.serve_tcp, fake.handle, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return fake, f"http://127.0.0.1:{port}"


async def test_streaming_completion_measures_ttft_tokens_and_route(server):
    fake, url = server
    client = HttpClient()
    release = trio.Event()
    fake.hold_first_token = release
    body = unique_prompts(seed=1, count=1)[0].body("tiny", stream=True)
    result: list[RequestResult] = []

    async def run():
        result.append(await completion(client, url + "/v1/chat/completions", body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.sleep(0.2)
        release.set()
    (r,) = result
    assert r.ok, r
    assert (r.status, r.route, r.output_tokens, r.content) == (200, "engine-1", 3, "w1 two three")
    assert (r.prompt_tokens, r.cached_tokens) == (40, 32)
    # The first content chunk was held back at least 0.2 s after the role-only chunk arrived.
    assert r.ttft is not None and 0.2 <= r.ttft <= r.total
    await client.aclose()


async def test_keep_alive_reuses_one_connection(server):
    fake, url = server
    client = HttpClient()
    for conv in unique_prompts(seed=2, count=5):
        r = await completion(client, url + "/v1/chat/completions", conv.body("tiny", stream=False))
        assert r.ok and r.output_tokens == 2 and r.content == "a b" and r.ttft is None
    assert fake.connections == 1
    assert await model_name(client, url) == "tiny"
    assert fake.connections == 1
    await client.aclose()


async def test_a_stale_pooled_connection_is_retried_on_a_new_one_not_another_pooled_one(server):
    fake, url = server
    fake.one_request_per_connection = True
    client = HttpClient()
    bodies = [c.body("tiny", stream=False) for c in unique_prompts(seed=3, count=3)]
    async with trio.open_nursery() as nursery:
        for body in bodies[:2]:
            nursery.start_soon(completion, client, url + "/v1/chat/completions", body)
    assert fake.connections == 2
    await trio.sleep(0.05)
    r = await completion(client, url + "/v1/chat/completions", bodies[2])
    assert r.ok, r
    assert fake.connections == 3
    await client.aclose()


async def test_malformed_stream_is_survived(server):
    _, url = server
    client = HttpClient()
    body = unique_prompts(seed=3, count=1)[0].body("broken", stream=True)
    r = await completion(client, url + "/v1/chat/completions", body)
    assert r.status == 200 and r.content == "x"
    assert r.error == "stream ended early"
    await client.aclose()


async def test_unreachable_server_is_an_error_not_an_exception():
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, lambda s: s.aclose(), 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()
    client = HttpClient()
    r = await completion(client, f"http://127.0.0.1:{port}/v1/chat/completions", {"stream": True}, timeout=5)
    assert not r.ok and r.error


async def test_closed_loop_keeps_turn_order_and_feeds_answers(server):
    fake, url = server
    client = HttpClient()
    convs = multi_turn(seed=4, conversations=3, turns=3, system_tokens=5)
    results, wall = await run_closed_loop(client, url, convs, concurrency=2, model="tiny")
    assert len(results) == 9 and all(r.ok for r in results) and wall > 0
    assert fake.connections <= 2
    for conv in convs:
        sent = [b for b in fake.requests if b["user"] == conv.key]
        assert [len(b["messages"]) for b in sent] == [2, 4, 6]
        answers = [m["content"] for m in sent[-1]["messages"] if m["role"] == "assistant"]
        assert answers == [r.content for r in results if r.content in answers]
        assert all(a.endswith(" two three") for a in answers)


async def test_closed_loop_takes_router_replicas_in_turn_and_names_each_turn(nursery):
    fakes = [FakeOpenAI(), FakeOpenAI()]
    urls = []
    for fake in fakes:
        listeners = await nursery.start(partial(trio.serve_tcp, fake.handle, 0, host="127.0.0.1"))
        urls.append(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    client = HttpClient()
    convs = multi_turn(seed=5, conversations=3, turns=2, system_tokens=5)
    results, _ = await run_closed_loop(client, urls, convs, concurrency=1, model="tiny")
    await client.aclose()
    assert [len(f.requests) for f in fakes] == [3, 3]
    assert sorted((r.key, r.turn) for r in results) == sorted((c.key, t) for c in convs for t in range(2))


def test_a_balancer_takes_replicas_in_turn_and_after_the_kill_only_the_survivors():
    killed = []
    balancer = Balancer(["http://a/", "http://b", "http://c"], kill_after=4, on_kill=killed.append)
    picks = [balancer.next() for _ in range(8)]
    hosts = [p.removeprefix("http://").removesuffix("/v1/chat/completions") for p in picks]
    assert hosts[:4] == ["a", "b", "c", "a"] and killed == ["http://c"] and balancer.killed_at == 4
    assert set(hosts[4:]) == {"a", "b"} and sorted(Counter(hosts[4:]).values()) == [2, 2]
    assert not balancer.is_live("http://c/v1/chat/completions") and balancer.is_live(picks[0])
    assert Balancer("http://a").next() == "http://a/v1/chat/completions"
    with pytest.raises(ValueError):
        Balancer(["http://a"], kill_after=1)
    with pytest.raises(ValueError):
        Balancer([])


async def test_a_turn_in_flight_on_a_killed_replica_is_sent_again_to_a_survivor(nursery):
    """The second replica holds its first answer; the third pick kills it: that turn breaks and is resent to the
    first replica, which answers every turn after it, and the run ends with no error."""
    fakes = [FakeOpenAI(), FakeOpenAI(hold_first_token=trio.Event())]
    scopes, urls = [], []
    for fake in fakes:
        scope = trio.CancelScope()
        scopes.append(scope)

        async def serve(handler=fake.handle, scope=scope, task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await trio.serve_tcp(handler, 0, host="127.0.0.1", task_status=task_status)

        listeners = await nursery.start(serve)
        urls.append(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    balancer = Balancer(urls, kill_after=2, on_kill=lambda url: scopes[urls.index(url)].cancel())
    client = HttpClient()
    convs = multi_turn(seed=7, conversations=2, turns=2, system_tokens=5)
    with trio.fail_after(10):
        results, _ = await run_closed_loop(client, balancer, convs, concurrency=2, model="tiny")
    await client.aclose()
    assert balancer.killed_at == 2 and len(fakes[1].requests) == 1
    assert len(results) == 4 and all(r.ok for r in results)
    (retried,) = [r for r in results if r.retried]
    assert retried.ttft is not None and retried.ttft <= retried.total
    assert len(fakes[0].requests) == 4


async def test_sessions_arrive_on_their_own_and_send_their_turns_in_order(server):
    """Open loop: the third chat starts before the first has finished (arrivals do not wait for answers), and each
    chat's turns go one after the other, each carrying the answers before it."""
    fake, url = server
    client = HttpClient()
    convs = multi_turn(seed=6, conversations=3, turns=3, system_tokens=5)
    fake.hold_first_token = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            box = []

            async def drive():
                box.append(await run_sessions(client, url, convs, 50.0, "tiny", random.Random(1)))

            nursery.start_soon(drive)
            while len(fake.requests) < 3:
                await trio.sleep(0.01)
            assert len({b["user"] for b in fake.requests}) == 3
            fake.hold_first_token.set()
    results, wall = box[0]
    await client.aclose()
    assert len(results) == 9 and all(r.ok for r in results) and wall > 0
    for conv in convs:
        sent = [b for b in fake.requests if b["user"] == conv.key]
        assert [len(b["messages"]) for b in sent] == [2, 4, 6]
    assert sorted((r.key, r.turn) for r in results) == sorted((c.key, t) for c in convs for t in range(3))


async def test_open_loop_starts_at_the_rate_and_caps_in_flight(autojump_clock):
    gate = trio.Event()

    async def send(i: int, started: float) -> RequestResult:
        if i >= 2:
            await gate.wait()
        return RequestResult(started=started, status=200)

    async with trio.open_nursery() as nursery:
        report_box = []

        async def drive():
            report_box.append(await run_open_loop(send, rate=200.0, duration=0.1, max_in_flight=3))

        nursery.start_soon(drive)
        await trio.sleep(0.3)
        gate.set()
    (report,) = report_box
    # 20 starts scheduled; 2 finish at once, 3 stay blocked at the cap, the other 15 are refused.
    assert (len(report.results), report.skipped) == (5, 15)
    starts = sorted(r.started for r in report.results)
    assert starts == pytest.approx([0.0, 0.005, 0.010, 0.015, 0.020])


async def test_scrape_reads_counters_and_marks_dead_engines(server):
    fake, url = server
    client = HttpClient()
    before = await engine_stats.scrape(client, [url, "http://127.0.0.1:1"])
    fake.requests.extend([{}] * 30)
    after = await engine_stats.scrape(client, [url, "http://127.0.0.1:1"])
    assert (before.failures, after.failures) == (1, 1)
    deltas = engine_stats.deltas(before, after)
    assert deltas[0][engine_stats.HITS] == 30.0 and deltas[1] == {}
    await client.aclose()
