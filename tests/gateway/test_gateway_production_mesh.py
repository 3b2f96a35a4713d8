"""Two meshed router replicas with tenants: a tenant's rate limit holds across the cluster, and an
admin change made on one replica is applied by the other."""

import os
import socket
import threading
import time

import pytest
from gateway_http import Http, chat
from gateway_production_helpers import bearer, engine_id, new_keys, served_by, wait_until, write_config

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess
from gateway.routing import public_engine_name

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
    return new_keys("admin", "metered", "solo", "free")


@pytest.fixture(scope="module")
def fleet():
    with SimFleetProcess(engines=2, profile="fast", time_scale=0.2) as sims:
        yield sims


@pytest.fixture(scope="module")
def replicas(fleet, keys, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mesh")
    secret = folder / "mesh.secret"
    secret.write_text(os.urandom(24).hex())
    tenants = [{"name": "metered", "requests_per_second": RATE}, {"name": "solo", "requests_per_second": RATE},
               {"name": "free"}]
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


def hammer(urls: list[str], key: str, seconds: float) -> tuple[list[int], list[dict]]:
    """Three client threads per replica, each far above the limit; returns (admitting replica per 200,
    headers per 429)."""
    admitted: list[int] = []
    limited: list[dict] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def worker(replica: int, worker: int) -> None:
        client = Http(urls[replica])
        i = 0
        while time.monotonic() < deadline:
            status, head, _ = client.request("POST", "/v1/chat/completions", chat(f"limited {worker} {i}"),
                                             bearer(key))
            assert status in (200, 429), status
            with lock:
                (admitted.append(replica) if status == 200 else limited.append(head))
            i += 1
            time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(w % len(urls), w)) for w in range(3 * len(urls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    return admitted, limited


def test_tenant_rate_limit_holds_across_replicas(replicas, keys):
    admitted, limited = hammer([r.url for r in replicas], keys["metered"], LOAD_S)
    assert len(limited) > PER_REPLICA_ONLY, "the offered load was too small to test the limit"
    assert 0 < len(admitted) <= CLUSTER_BOUND, (len(admitted), CLUSTER_BOUND)
    assert all(int(head["retry-after"]) >= 1 for head in limited)
    assert set(admitted) == {0, 1}, "one replica admitted nothing"


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
            assert served_by(head["x-kvmesh-route"]) == public_engine_name(other), "a tenant sees no address"
    finally:
        Http(first.url).json("POST", f"/admin/engines/{drained}/drain", {"enabled": False}, admin)
    assert wait_until(lambda: not draining_on_second(), 5)


def test_a_departed_replica_returns_its_share_at_once(replicas, keys):
    """Last in this module. With a replica gone, the survivor may use the whole budget: its own bucket
    (RATE * LOAD_S + capacity = 25) is then the bound, not half the window's budget (16), which is what a
    stale, never-forgotten peer would leave it."""
    survivor, leaving = replicas
    leaving.stop()

    def alone() -> bool:
        members = Http(survivor.url).json("GET", "/admin/mesh", headers=bearer(keys["admin"]))[2]["members"]
        return [m["state"] for m in members if m["state"] in ("alive", "suspect")] == ["alive"]

    assert wait_until(alone, 10)
    time.sleep(3.5)  # past peer_stale_after_s: the departed replica's last counts are stale by now
    admitted, _ = hammer([survivor.url], keys["solo"], LOAD_S)
    assert len(admitted) > RATE * WINDOW_S / 2 + 2, len(admitted)
