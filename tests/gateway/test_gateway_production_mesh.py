"""Two meshed router replicas with tenants: a tenant's rate limit holds across the cluster, and an
admin change made on one replica is applied by the other."""

import os
import socket
import threading
import time

import pytest
from conftest import Http, chat
from gateway_production_helpers import bearer, engine_id, new_keys, served_by, wait_until, write_config

from cluster.router_process import RouterProcess
from sim.process import SimFleetProcess

pytestmark = [pytest.mark.integration, pytest.mark.mesh]

RATE = 4.0
WINDOW_S = 8.0
SLOTS = 16
BURST_S = 0.25
LOAD_S = 6.0
"""The whole load fits inside one slot-aligned window (LOAD_S + one slot + latency < WINDOW_S), so the
cluster may admit at most RATE * WINDOW_S plus the documented slack (gateway/admission/ratelimit.py):
(N - 1) * (RATE * d + bucket capacity), d = how late a peer's counts arrive (publish interval 0.3 s plus
replication; 1 s allowed here for a noisy machine). Per-replica limits alone would admit
N * (RATE * LOAD_S + capacity) = 50, clearly more than the cluster bound of 32 + 5."""
CAPACITY = max(1.0, RATE * BURST_S)
CLUSTER_BOUND = RATE * WINDOW_S + (RATE * 1.0 + CAPACITY)
PER_REPLICA_ONLY = 2 * (RATE * LOAD_S + CAPACITY)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def keys() -> dict[str, str]:
    return new_keys("admin", "metered", "free")


@pytest.fixture(scope="module")
def fleet():
    with SimFleetProcess(engines=2, profile="fast", time_scale=0.2) as sims:
        yield sims


@pytest.fixture(scope="module")
def replicas(fleet, keys, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mesh")
    secret = folder / "mesh.secret"
    secret.write_text(os.urandom(24).hex())
    tenants = [{"name": "metered", "requests_per_second": RATE}, {"name": "free"}]
    config = write_config(folder / "router.toml", keys, tenants,
                          admission={"request_window_s": WINDOW_S, "request_slots": SLOTS,
                                     "request_burst_s": BURST_S})
    ports = [free_udp_port() for _ in range(2)]
    routers = []
    try:
        for port in ports:
            seeds = ",".join(f"127.0.0.1:{p}" for p in ports if p != port)
            routers.append(RouterProcess(fleet.urls, config=config, mesh_bind=f"127.0.0.1:{port}", seeds=seeds,
                                         mesh_secret_file=str(secret), metrics_interval=0.2).start())

        def members(router: RouterProcess) -> int:
            return len(Http(router.url).json("GET", "/admin/mesh", headers=bearer(keys["admin"]))[2]["members"])

        assert wait_until(lambda: all(members(r) == 2 for r in routers), 15), "the replicas never met"
        time.sleep(1.0)  # a few rate-limit heartbeats, so each replica knows the other's share
        yield routers
    finally:
        for router in routers:
            router.stop()


def test_tenant_rate_limit_holds_across_replicas(replicas, keys):
    admitted: list[int] = []
    limited: list[dict] = []
    lock = threading.Lock()
    deadline = time.monotonic() + LOAD_S

    def hammer(url: str, worker: int) -> None:
        client = Http(url)
        i = 0
        while time.monotonic() < deadline:
            status, head, _ = client.request("POST", "/v1/chat/completions", chat(f"metered {worker} {i}"),
                                             bearer(keys["metered"]))
            with lock:
                if status == 200:
                    admitted.append(worker)
                elif status == 429:
                    limited.append(head)
                else:
                    raise AssertionError(f"unexpected status {status}")
            i += 1
            time.sleep(0.05)

    threads = [threading.Thread(target=hammer, args=(r.url, w)) for w, r in enumerate(replicas * 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(LOAD_S + 30)
    assert len(limited) > PER_REPLICA_ONLY, "the offered load was too small to test the limit"
    assert 0 < len(admitted) <= CLUSTER_BOUND, (len(admitted), CLUSTER_BOUND)
    assert all(int(head["retry-after"]) >= 1 for head in limited)
    by_replica = [sum(1 for w in admitted if w % 2 == i) for i in range(2)]
    assert all(by_replica), f"one replica admitted nothing: {by_replica}"


def test_unlimited_tenant_is_not_limited(replicas, keys):
    client = Http(replicas[0].url)
    statuses = {client.request("POST", "/v1/chat/completions", chat(f"free {i}"), bearer(keys["free"]))[0]
                for i in range(3 * int(RATE))}
    assert statuses == {200}


def test_drain_on_one_replica_is_applied_by_the_other(replicas, keys, fleet):
    first, second = replicas
    drained, other = (engine_id(u) for u in fleet.urls)
    admin = bearer(keys["admin"])

    def draining_on_second() -> bool:
        rows = Http(second.url).json("GET", "/admin/engines", headers=admin)[2]["engines"]
        return next(row["draining"] for row in rows if row["id"] == drained)

    status, _, _ = Http(first.url).json("POST", f"/admin/engines/{drained}/drain", {}, admin)
    assert status == 200
    try:
        assert wait_until(draining_on_second, 5), "the drain never reached the other replica"
        client = Http(second.url)
        for i in range(6):
            status, head, _ = client.request("POST", "/v1/chat/completions", chat(f"after drain {i}"),
                                             bearer(keys["free"]))
            assert status == 200
            assert served_by(head["x-kvmesh-route"]) == other
    finally:
        Http(first.url).json("POST", f"/admin/engines/{drained}/drain", {"enabled": False}, admin)
    assert wait_until(lambda: not draining_on_second(), 5)
