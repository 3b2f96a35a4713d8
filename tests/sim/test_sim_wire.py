"""The engine over real loopback HTTP and ZeroMQ: SSE bytes, errors, keep-alive, events, replay,
metrics and faults."""

import json

import h11
import msgpack
import pytest
import trio
import zmq

from cluster.sim_process import SimFleetProcess
from index.vllm_hash import block_hashes, to_u64
from sim.config import EngineConfig, FleetConfig
from sim.fleet import run_fleet

pytestmark = pytest.mark.integration
MSGS = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Say hi."}]


class Client:
    """A keep-alive HTTP/1.1 client over one trio stream (h11)."""

    def __init__(self, stream):
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port):
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def request(self, method, path, body=None, raw=None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
        headers = [("host", "sim"), ("content-length", str(len(data))), ("content-type", "application/json")]
        await self.stream.send_all(self.conn.send(h11.Request(method=method, target=path, headers=headers)))
        await self.stream.send_all(self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage()))
        status, chunks = None, []
        while True:
            ev = self.conn.next_event()
            if ev is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
            elif isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                chunks.append(bytes(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                self.conn.start_next_cycle()
                return status, chunks


@pytest.fixture
async def fleet(nursery):
    cfg = FleetConfig(engines=2, engine=EngineConfig(num_blocks=64, block_size=16))
    return await nursery.start(run_fleet, cfg)


async def test_sse_stream_is_framed_like_vllm(fleet):
    c = await Client.open(fleet[0].info.port)
    status, chunks = await c.request("POST", "/v1/chat/completions", {
        "model": "kvmesh-tiny", "messages": MSGS, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}, "some_unknown_field": 1})
    assert status == 200
    body = b"".join(chunks)
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    events = body.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    objs = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert list(objs[0]) == ["id", "object", "created", "model", "choices"]
    assert objs[0]["id"].startswith("chatcmpl-") and objs[0]["object"] == "chat.completion.chunk"
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [o["choices"][0]["finish_reason"] for o in objs[1:4]] == [None, None, "length"]
    assert objs[4]["choices"] == [] and objs[4]["usage"]["completion_tokens"] == 3
    assert b'"delta":{"content":' in events[1] and b", " not in events[0]


async def test_errors_and_keep_alive(fleet):
    c = await Client.open(fleet[0].info.port)
    status, body = await c.request("POST", "/v1/chat/completions", {"model": "nope", "messages": MSGS})
    err = json.loads(b"".join(body))["error"]
    assert status == 404 and set(err) == {"message", "type", "param", "code"} and err["code"] == 404
    status, body = await c.request("POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and json.loads(b"".join(body))["error"]["type"] == "BadRequestError"
    status, body = await c.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9})
    assert status == 400
    status, body = await c.request("GET", "/load")
    assert status == 200 and json.loads(b"".join(body)) == {"server_load": 0}
    status, body = await c.request("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
    resp = json.loads(b"".join(body))
    assert status == 200 and resp["usage"]["prompt_tokens"] == 3 and resp["object"] == "text_completion"


async def _recv_batches(sub, want_blocks, limit_s=10):
    got = []
    with trio.move_on_after(limit_s):
        while sum(len(e["block_hashes"]) for _, b in got for e in b[1] if e["type"] == "BlockStored") < want_blocks:
            try:
                topic, seq, payload = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await trio.sleep(0.01)
                continue
            assert topic == b"kv" and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))
    return got


async def test_events_on_real_sub_match_the_vllm_recipe_and_replay(fleet):
    engine = fleet[1]
    c = await Client.open(engine.info.port)
    _, src = await c.request("GET", "/kv_event_sources")
    cfg = json.loads(b"".join(src))["0"]
    assert cfg["endpoint"] == f"tcp://*:{engine.info.event_port}" and cfg["topic"] == "kv"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(cfg["endpoint"].replace("*", "127.0.0.1"))
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(cfg["replay_endpoint"].replace("*", "127.0.0.1"))
    try:
        _, tok = await c.request("POST", "/tokenize", {"model": "kvmesh-tiny", "messages": MSGS})
        ids = json.loads(b"".join(tok))["tokens"]
        want = [to_u64(h) for h in block_hashes(ids, 16)]
        # the subscription may take a moment to reach the PUB: resend until events arrive
        batches = []
        for _ in range(20):
            await c.request("POST", "/reset_prefix_cache")
            await c.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1})
            batches = await _recv_batches(sub, len(want), limit_s=0.5)
            if batches:
                break
        stored = [e for _, b in batches for e in b[1] if e["type"] == "BlockStored"]
        assert [h for e in stored for h in e["block_hashes"]][: len(want)] == want
        first = stored[0]
        assert list(first)[:5] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size"]
        assert first["parent_block_hash"] is None and first["medium"] == "GPU"
        assert first["token_ids"] == ids[: 16 * len(first["block_hashes"])]
        last_seq = batches[-1][0]
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        with trio.fail_after(5):
            while not frames or frames[-1][2] != b"\xff" * 8:
                try:
                    frames.append(dealer.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    await trio.sleep(0.01)
        assert frames[-1] == [b"", b"", b"\xff" * 8, b""]
        seqs = [int.from_bytes(f[2], "big") for f in frames[:-1]]
        assert seqs == list(range(last_seq + 1)) and all(f[1] == b"kv" for f in frames[:-1])
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()


async def test_metrics_have_vllm_names_and_count_hits(fleet):
    c = await Client.open(fleet[0].info.port)
    for _ in range(2):
        await c.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
    _, body = await c.request("GET", "/metrics")
    text = b"".join(body).decode()
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:prompt_tokens_cached_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count"]:
        assert f'{name}{{' in text, name
    assert 'num_gpu_blocks="64"' in text and 'prefix_caching_hash_algo="sha256"' in text
    hits = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total")]
    assert float(hits[0].split()[-1]) > 0
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="kvmesh-tiny"} 2.0' in text


async def test_faults_fail_then_clear_then_die(fleet):
    c = await Client.open(fleet[0].info.port)
    await c.request("POST", "/sim/fault", {"fail_5xx": True})
    status, _ = await c.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 500
    await c.request("POST", "/sim/fault", {"clear": True})
    status, _ = await c.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 200
    status, _ = await c.request("POST", "/sim/fault", {"slow": "fast"})
    assert status == 400
    with pytest.raises(h11.RemoteProtocolError):  # dies like a crash: the request gets no answer
        await c.request("POST", "/sim/fault", {"die": True})
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", fleet[0].info.port)
    other = await Client.open(fleet[1].info.port)
    assert (await other.request("GET", "/health"))[0] == 200


def test_openai_client_against_a_sim_process():
    from openai import OpenAI

    with SimFleetProcess(engines=1, event_encoding="array") as fleet:
        client = OpenAI(base_url=fleet.urls[0] + "/v1", api_key="x")
        chunks = list(client.chat.completions.create(model="kvmesh-tiny", messages=MSGS, max_tokens=4,
                                                     stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"
        full = client.chat.completions.create(model="kvmesh-tiny", messages=MSGS, max_tokens=4)
        assert full.usage.prompt_tokens_details.cached_tokens > 0
        assert full.usage.completion_tokens == 4
        assert [m.id for m in client.models.list()] == ["kvmesh-tiny"]
