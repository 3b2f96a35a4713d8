"""The production gateway with auth on, in front of one simulated engine: API keys, admin keys, cache
isolation seen through the engine's own prefix-cache counters, priority shedding and client disconnects."""

import json

import pytest
from gateway_http import Http, chat
from gateway_production_helpers import (
    HITS,
    RUNNING,
    bearer,
    engine_counter,
    engine_id,
    new_keys,
    open_stream,
    set_fault,
    wait_until,
    write_config,
)

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = pytest.mark.integration
QUEUE_THRESHOLD = 4
LONG_PROMPT = " ".join(f"clause {i} of the shared master services agreement" for i in range(60))


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    return new_keys("admin", "alpha", "beta", "open")


@pytest.fixture(scope="module")
def engine():
    with SimFleetProcess(engines=1, profile="fast", time_scale=0.2) as sims:
        yield sims.urls[0]


@pytest.fixture(scope="module")
def router(engine, keys, tmp_path_factory):
    tenants = [{"name": "alpha", "cache": "isolated"}, {"name": "beta", "cache": "isolated"},
               {"name": "open", "cache": "shared", "allow_priority_header": True}]
    config = write_config(tmp_path_factory.mktemp("tenants") / "router.toml", keys, tenants,
                          log_level="debug", admission={"queue_threshold": QUEUE_THRESHOLD})
    with RouterProcess([engine], config=config, metrics_interval=0.2) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(router) -> Http:
    return Http(router.url)


def error_of(data: bytes) -> dict:
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_missing_and_wrong_keys_get_openai_401(client, keys):
    status, _, data = client.request("POST", "/v1/chat/completions", chat("hi"))
    assert status == 401
    assert error_of(data)["type"] == "authentication_error"
    assert error_of(data)["code"] == "missing_api_key"
    wrong = keys["alpha"][:-2] + "xx"
    status, _, data = client.request("POST", "/v1/chat/completions", chat("hi"), bearer(wrong))
    assert status == 401
    assert error_of(data)["code"] == "invalid_api_key"
    assert wrong.encode() not in data
    status, _, _ = client.request("POST", "/v1/chat/completions", chat("hi"), {"authorization": "Basic abc"})
    assert status == 401


def test_valid_key_is_served(client, keys):
    status, head, data = client.request("POST", "/v1/chat/completions", chat("hello there"), bearer(keys["alpha"]))
    assert status == 200, data
    assert json.loads(data)["choices"][0]["message"]["content"]
    assert "x-kvmesh-route" in head


def test_admin_paths_need_an_admin_key(client, keys):
    assert client.request("GET", "/admin/engines", headers={})[0] == 401
    status, _, data = client.request("GET", "/admin/engines", headers=bearer(keys["alpha"]))
    assert status == 403
    assert error_of(data)["type"] == "permission_error"
    status, _, data = client.request("GET", "/admin/engines", headers=bearer(keys["admin"]))
    assert status == 200
    assert len(json.loads(data)["engines"]) == 1


def test_isolated_tenants_never_share_engine_cache(client, keys, engine):
    """The engine's own hit counter: beta's first copy of alpha's prompt hits nothing; alpha's repeat hits."""
    body = chat(LONG_PROMPT, max_tokens=1)

    def send(tenant: str) -> float:
        status, _, data = client.request("POST", "/v1/chat/completions", body, bearer(keys[tenant]))
        assert status == 200, data
        return engine_counter(engine, HITS)

    after_alpha = send("alpha")
    after_beta = send("beta")
    after_open = send("open")
    after_alpha_again = send("alpha")
    assert after_beta == after_alpha, "beta's first request hit alpha's cached blocks"
    assert after_open == after_beta, "a shared tenant hit an isolated tenant's blocks"
    assert after_alpha_again - after_open >= 256, "alpha's repeat did not reuse alpha's own blocks"


def test_shared_tenant_may_not_use_reserved_salt(client, keys):
    body = chat("salted", cache_salt="kvmesh:0123456789abcdef")
    status, _, data = client.request("POST", "/v1/chat/completions", body, bearer(keys["open"]))
    assert status == 400
    assert error_of(data)["param"] == "cache_salt"
    status, _, _ = client.request("POST", "/v1/chat/completions", chat("salted", cache_salt="mine"),
                                  bearer(keys["open"]))
    assert status == 200


def test_keys_never_leak_into_logs_metrics_or_headers(client, router, keys):
    _, head, _ = client.request("POST", "/v1/chat/completions", chat("leak check"), bearer(keys["beta"]))
    client.request("GET", "/admin/engines", headers=bearer(keys["beta"]))
    _, _, metrics = client.request("GET", "/metrics")
    logs = router.stderr()
    assert "routed" in logs, "the router logged nothing: the check below would prove nothing"
    for key in keys.values():
        assert key not in logs
        assert key.encode() not in metrics
        assert all(key not in value for value in head.values())


def in_flight(router, keys, engine: str) -> int:
    rows = Http(router.url).json("GET", "/admin/engines", headers=bearer(keys["admin"]))[2]["engines"]
    return next(row["in_flight"] for row in rows if row["id"] == engine_id(engine))


def hold(router, keys, held: list, count: int) -> None:
    """Open high-priority streams on the (slowed) engine until the router has ``count`` in flight."""
    long_stream = chat("keep decoding", max_tokens=400, stream=True)
    while len(held) < count:
        held.append(open_stream(router.url, long_stream, bearer(keys["open"], **{"x-priority": "high"})))


@pytest.fixture()
def slowed(engine):
    """A step takes ~0.1 s: a 400-token answer decodes for ~40 s, far longer than any wait below."""
    set_fault(engine, slow=400)
    yield engine
    set_fault(engine, clear=True)


def test_low_priority_is_shed_first_normal_next_high_never(client, router, keys, slowed):
    def status_at(priority: str) -> tuple[int, dict]:
        headers = bearer(keys["open"], **{"x-priority": priority})
        status, head, _ = client.request("POST", "/v1/chat/completions", chat(f"probe {priority}", max_tokens=1),
                                         headers)
        return status, head

    held: list = []
    try:
        for count in (QUEUE_THRESHOLD // 2, QUEUE_THRESHOLD):
            hold(router, keys, held, count)
            assert wait_until(lambda n=count: in_flight(router, keys, slowed) == n, 15), f"never saw {count}"
            low, low_head = status_at("low")
            assert low == 429
            assert int(low_head["retry-after"]) >= 1
            assert status_at("normal")[0] == (200 if count < QUEUE_THRESHOLD else 429)
            assert status_at("high")[0] == 200
    finally:
        for sock in held:
            sock.close()
    _, _, metrics = client.request("GET", "/metrics")
    assert b'kvmesh_admission_rejections_total{priority="low",reason="overloaded"} 2.0' in metrics
    assert b'kvmesh_admission_rejections_total{priority="normal",reason="overloaded"} 1.0' in metrics
    assert b'priority="high"' not in metrics


def test_client_disconnect_cancels_the_engine_request(router, keys, slowed):
    held: list = []
    try:
        hold(router, keys, held, 3)
        assert wait_until(lambda: engine_counter(slowed, RUNNING) == 3, 15), "the engine never ran them"
    finally:
        for sock in held:
            sock.close()
    # Left alone they would decode for ~40 s: dropping to zero within seconds means they were aborted.
    assert wait_until(lambda: engine_counter(slowed, RUNNING) == 0, 8), "engine kept working for gone clients"
    assert wait_until(lambda: in_flight(router, keys, slowed) == 0, 5)
