"""The gateway in front of simulated engines: proxying, streaming, errors, routing explanation."""

import json
import socket
import time

import pytest
from gateway_http import MODEL, Http, chat
from gateway_production_helpers import set_fault

pytestmark = pytest.mark.integration


def test_models_health_ready_metrics(client):
    status, _, body = client.json("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL]
    assert client.json("GET", "/health")[0] == 200
    assert client.json("GET", "/ready")[2] == {"ready": True}
    client.json("POST", "/v1/chat/completions", chat("count me"))
    status, _, text = client.request("GET", "/metrics")
    assert status == 200 and b'kvmesh_requests_total{endpoint="/v1/chat/completions",status="200"}' in text


def test_chat_and_completion_are_proxied_with_route_header(client):
    status, head, body = client.json("POST", "/v1/chat/completions", chat("hello engine"))
    assert status == 200 and body["object"] == "chat.completion"
    assert head["x-kvmesh-route"].startswith("engine=")
    assert "prompt_tokens_details" in body["usage"]
    completion = {"model": MODEL, "prompt": "once upon", "max_tokens": 3}
    status, head, body = client.json("POST", "/v1/completions", completion)
    assert status == 200 and body["object"] == "text_completion" and "x-kvmesh-route" in head


def test_stream_is_forwarded_chunk_by_chunk(router, fleet):
    """The first token reaches the client while the engine is still decoding the rest."""
    # Slowed 200x, 40 decode steps take the engines ~1.6 s: a relay that buffered the answer would hand
    # over first and last token together, one that streams leaves most of that time between them.
    for url in fleet.urls:
        set_fault(url, slow=200.0)
    try:
        host, port = router.url.removeprefix("http://").split(":")
        body = json.dumps(chat("stream slowly please", max_tokens=40, stream=True)).encode()
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(body) + body)
            seen = b""
            first_at = None
            while b"data: [DONE]" not in seen:
                data = sock.recv(65536)
                assert data, "connection closed before [DONE]"
                seen += data
                if first_at is None and b'"content":"' in seen.split(b"\r\n\r\n", 1)[-1]:
                    first_at = time.perf_counter()
            done_at = time.perf_counter()
    finally:
        for url in fleet.urls:
            set_fault(url, clear=True)
    assert seen.startswith(b"HTTP/1.1 200")
    assert seen.count(b"data: ") >= 40
    assert done_at - first_at > 0.5


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
        (json.dumps({"model": MODEL}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": [{"content": "x"}]}).encode(), 400, "messages[0].role"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(),
         400, "stream"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(),
         400, "max_tokens"),
        (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode(), 404,
         "model"),
    ],
)
def test_bad_requests_get_openai_errors(client, body, status, param):
    got, head, data = client.request("POST", "/v1/chat/completions", body)
    error = json.loads(data)["error"]
    assert got == status and head["content-type"] == "application/json"
    assert error["param"] == param and error["message"] and error["type"]


def _raw_post(url: str, head: bytes, body: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        received = b""
        while data := sock.recv(65536):
            received += data
            if b"\r\n\r\n" in received and b"}}" in received:
                break
    return received


def test_oversized_body_and_wrong_method(client, router):
    """A body over the limit is refused from its declared length, before it is read."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 9437184\r\n\r\n"
    answer = _raw_post(router.url, head, b'{"model": "x", "messages": [')
    assert answer.startswith(b"HTTP/1.1 413")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_too_large"
    status, _, data = client.request("GET", "/v1/chat/completions")
    assert status == 405 and "POST" in json.loads(data)["error"]["message"]
    assert client.request("GET", "/nowhere")[0] == 404


def forwarded(client) -> float:
    """Requests the router has sent to engines (every first byte it received)."""
    text = client.request("GET", "/metrics")[2].decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvmesh_time_to_first_byte_seconds_count"))


def test_bad_input_changes_nothing(client):
    """A rejected request reaches no engine, while a good one does."""
    before = forwarded(client)
    for bad in (b"{broken", b'{"model": "kvmesh-tiny", "messages": []}', b'{"model": 5}'):
        assert client.request("POST", "/v1/chat/completions", bad)[0] == 400
    assert forwarded(client) == before
    client.json("POST", "/v1/chat/completions", chat("a good one"))
    assert forwarded(client) == before + 1


def test_debug_route_scores_without_sending(client):
    body = chat("explain me " * 20)
    status, _, table = client.json("POST", "/debug/route", body)
    assert status == 200 and table["policy"] == "kv_aware" and len(table["candidates"]) == 2
    assert table["prompt_tokens"] > 0 and table["chosen"] == table["candidates"][0]["engine"]


def test_repeated_prefix_goes_where_it_is_cached(client):
    """After the first request's BlockStored events arrive, siblings go to the same engine with overlap."""
    document = "The quick brown fox jumps over the lazy dog near the river bank. " * 30
    first = client.json("POST", "/v1/chat/completions", chat(document + " Question one?"))[1]["x-kvmesh-route"]
    engine = first.split(";")[0]
    time.sleep(0.3)
    for question in ("two", "three", "four"):
        head = client.json("POST", "/v1/chat/completions", chat(document + f" Question {question}?"))[1]
        route = head["x-kvmesh-route"]
        assert route.split(";")[0] == engine
        overlap = int(route.split("overlap=")[1].split("/")[0])
        assert overlap > 300


def test_debug_route_names_the_home_a_sent_prefix_got(client):
    """Only a request that was sent gives its prefix a home; /debug/route shows it and that the choice is home."""
    document = "A slow green turtle crosses the old stone bridge at dawn. " * 30
    route = client.json("POST", "/v1/chat/completions", chat(document + " Where?"))[1]["x-kvmesh-route"]
    engine = route.split(";")[0].removeprefix("engine=")
    home = client.json("POST", "/debug/route", chat(document + " When?"))[2]["home"]
    assert home["homes"] == [engine] and home["heat"] > 0
    assert home["chosen_is_home"] is True and home["left_home_because"] is None


def test_unreachable_engine_is_retried_elsewhere(fleet):
    """A dead engine in the list costs a retry, never a client error."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    from cluster.router_process import RouterProcess

    with RouterProcess([dead, fleet.urls[0]], policy="round_robin") as proc:
        client = Http(proc.url)
        dead_id = dead.removeprefix("http://")
        for i in range(6):
            status, head, _ = client.json("POST", "/v1/chat/completions", chat(f"retry {i}"))
            assert status == 200
            assert dead_id not in head["x-kvmesh-route"].split("served_by=")[-1]


def test_5xx_fails_over_and_no_engine_gives_503(fleet):
    from cluster.router_process import RouterProcess

    sick, healthy = Http(fleet.urls[0]), Http(fleet.urls[1])
    with RouterProcess(fleet.urls, policy="round_robin") as proc:
        client = Http(proc.await_all_routable().url)
        sick.json("POST", "/sim/fault", {"fail_5xx": True})
        try:
            for i in range(6):
                assert client.json("POST", "/v1/chat/completions", chat(f"failover {i}"))[0] == 200
            # a different failure on each engine: the engines are at fault, not the request
            healthy.json("POST", "/sim/fault", {"fail_5xx": True, "fail_status": 503})
            status, _, body = client.json("POST", "/v1/chat/completions", chat("nobody home"))
            assert status == 503 and "no engine" in body["error"]["message"]
        finally:
            sick.json("POST", "/sim/fault", {"clear": True})
            healthy.json("POST", "/sim/fault", {"clear": True})


def test_admin_index_reports_blocks_and_confidence(client):
    client.json("POST", "/v1/chat/completions", chat("admin index " * 40))
    time.sleep(0.3)
    status, _, report = client.json("GET", "/admin/index")
    assert status == 200 and len(report["engines"]) == 2
    rows = list(report["engines"].values())
    assert sum(r["blocks"] for r in rows) > 0
    assert all(0.0 <= r["confidence"] <= 1.0 and r["has_events"] for r in rows)
    assert all(r["digest"].endswith(f":{r['blocks']}") for r in rows)


def test_admin_drain_removes_engine_from_rotation(fleet):
    from cluster.router_process import RouterProcess

    with RouterProcess(fleet.urls, policy="round_robin") as proc:
        client = Http(proc.await_all_routable().url)
        engines = client.json("GET", "/admin/engines")[2]["engines"]
        drained = engines[0]["id"]
        status, _, row = client.json("POST", f"/admin/engines/{drained}/drain", {})
        assert status == 200 and row["draining"] is True
        for i in range(4):
            route = client.json("POST", "/v1/chat/completions", chat(f"drain {i}"))[1]["x-kvmesh-route"]
            assert f"engine={drained};" not in route
        client.json("POST", f"/admin/engines/{drained}/drain", {"enabled": False})
        routes = {client.json("POST", "/v1/chat/completions", chat(f"back {i}"))[1]["x-kvmesh-route"].split(";")[0]
                  for i in range(4)}
        assert f"engine={drained}" in routes
        assert client.json("DELETE", f"/admin/engines/{drained}")[0] == 200
        assert [e["id"] for e in client.json("GET", "/admin/engines")[2]["engines"]] == [engines[1]["id"]]
        assert client.json("POST", "/admin/engines", {"url": "ftp://nope"})[0] == 400
        status, _, row = client.json("POST", "/admin/engines", {"url": fleet.urls[0]})
        assert status == 201 and row["id"] == drained


def test_predicted_and_reported_cached_tokens_are_exported(client):
    """The router counts the cached tokens it predicted and those the engines reported in usage."""
    document = "Every good boy deserves fudge, said the music teacher again. " * 30

    def counters() -> tuple[float, float]:
        text = client.request("GET", "/metrics")[2].decode()
        values = {}
        for line in text.splitlines():
            for name in ("kvmesh_predicted_cached_tokens_total", "kvmesh_reported_cached_tokens_total"):
                if line.startswith(name + " "):
                    values[name] = float(line.split()[1])
        return values["kvmesh_predicted_cached_tokens_total"], values["kvmesh_reported_cached_tokens_total"]

    client.json("POST", "/v1/chat/completions", chat(document + "first?"))
    time.sleep(0.3)
    predicted, reported = counters()
    body = chat(document + "second?", stream=True, stream_options={"include_usage": True})
    status, _, _ = client.request("POST", "/v1/chat/completions", body)
    assert status == 200
    predicted_after, reported_after = counters()
    assert predicted_after - predicted >= 300
    assert reported_after - reported >= 300
