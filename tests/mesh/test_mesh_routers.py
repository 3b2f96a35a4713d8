"""Router replicas meshed on loopback in front of simulated engines: one index, everywhere."""

import json
import os
import signal
import socket
import threading
import time
import urllib.request

import pytest

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess

pytestmark = [pytest.mark.mesh, pytest.mark.integration]
MODEL = "kvmesh-tiny"


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, path: str, body: dict | None = None, timeout: float = 30.0):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read()), dict(response.headers)


def chat(text: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def digests(url: str) -> dict[str, str]:
    return {e: row["digest"] for e, row in call(url, "/admin/index")[0]["engines"].items()}


def wait_until(predicate, timeout: float, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


class Mesh:
    def __init__(self, engines: list[str], secret_file: str, size: int) -> None:
        self.engines = engines
        self.secret_file = secret_file
        self.ports = [free_udp_port() for _ in range(size)]
        self.routers: list[RouterProcess] = []

    def start(self, port: int, secret_file: str | None = None) -> RouterProcess:
        seeds = ",".join(f"127.0.0.1:{p}" for p in self.ports if p != port)
        router = RouterProcess(self.engines, mesh_bind=f"127.0.0.1:{port}", seeds=seeds,
                               mesh_secret_file=secret_file or self.secret_file, metrics_interval=0.2)
        router.start()
        self.routers.append(router)
        return router

    def stop(self) -> None:
        for router in self.routers:
            router.stop()


@pytest.fixture(scope="module")
def fleet():
    with SimFleetProcess(engines=2, profile="fast", time_scale=0.2) as sims:
        yield sims


@pytest.fixture()
def secret_file(tmp_path):
    path = tmp_path / "mesh.secret"
    path.write_text(os.urandom(24).hex())
    return str(path)


@pytest.fixture()
def mesh(fleet, secret_file):
    mesh = Mesh(fleet.urls, secret_file, size=4)
    try:
        for port in mesh.ports[:3]:
            mesh.start(port)
        wait_until(lambda: all(len(call(r.url, "/admin/mesh")[0]["members"]) == 3 for r in mesh.routers), 10)
        yield mesh
    finally:
        mesh.stop()


def converged(urls: list[str]):
    views = [digests(u) for u in urls]
    return views if all(v == views[0] for v in views) and any(not d.startswith("0" * 16) for d in views[0].values()) \
        else None


def test_replicas_converge_and_route_on_each_others_events(mesh):
    urls = [r.url for r in mesh.routers]
    document = "replicated knowledge is shared by every router replica " * 25
    call(urls[0], "/v1/chat/completions", chat(document + "first"))
    assert wait_until(lambda: converged(urls), 5), [digests(u) for u in urls]
    table, _ = call(urls[2], "/debug/route", chat(document + "second"))
    assert table["candidates"][0]["overlap_exact_tokens"] >= 300


def test_new_replica_is_warm_within_two_seconds(mesh):
    urls = [r.url for r in mesh.routers]
    for i in range(20):
        call(urls[i % 3], "/v1/chat/completions", chat(f"warm index document number {i} " * 20))
    assert wait_until(lambda: converged(urls), 5)
    late = mesh.start(mesh.ports[3])
    started = time.monotonic()
    assert wait_until(lambda: digests(late.url) == digests(urls[0]), 2.0)
    assert time.monotonic() - started <= 2.5
    assert call(late.url, "/admin/mesh")[0]["index_transfer"].get("warm_starts", 0) >= 1


def test_killed_replicas_cost_the_survivor_no_events(mesh, fleet):
    """Two of three replicas die; the survivor ingests every engine itself, so nothing it indexes is lost."""
    urls = [r.url for r in mesh.routers]
    engine_url = fleet.urls[0]
    engine_id = engine_url.removeprefix("http://")
    survivor = mesh.routers[2]
    assert wait_until(lambda: engine_id in call(survivor.url, "/admin/mesh")[0]["ingesting"], 10)
    for router in mesh.routers[:2]:
        os.kill(router.pid, signal.SIGKILL)
    document = "events published while the other replicas were dead must not be lost " * 40
    call(engine_url, "/v1/chat/completions", chat(document))

    def survivor_knows() -> bool:
        table, _ = call(survivor.url, "/debug/route", chat(document))
        row = next(c for c in table["candidates"] if c["engine"] == engine_id)
        return row["overlap_exact_tokens"] >= 256

    assert wait_until(survivor_knows, 8.0, step=0.5)  # /debug/route allows 2 calls/s
    assert urls


def test_replica_with_wrong_secret_is_refused(mesh, tmp_path):
    other = tmp_path / "other.secret"
    other.write_text(os.urandom(24).hex())
    intruder = mesh.start(mesh.ports[3], secret_file=str(other))
    time.sleep(2.0)
    assert [m["id"] for m in call(intruder.url, "/admin/mesh")[0]["members"]] == [
        call(intruder.url, "/admin/mesh")[0]["member_id"]]
    for router in mesh.routers[:3]:
        assert len(call(router.url, "/admin/mesh")[0]["members"]) == 3


def test_engines_without_events_share_their_approximate_entries(secret_file):
    """A replica learns where another replica sent a prompt, for engines that publish no KV events."""
    with SimFleetProcess(engines=2, profile="fast", time_scale=0.2, no_events=True) as quiet:
        mesh = Mesh(quiet.urls, secret_file, size=2)
        try:
            first, second = (mesh.start(port) for port in mesh.ports)
            assert wait_until(lambda: len(call(second.url, "/admin/mesh")[0]["members"]) == 2, 10)
            document = "nobody announces these blocks but the router that sent them " * 20
            _, headers = call(first.url, "/v1/chat/completions", chat(document + "one"))
            engine = headers["x-kvmesh-route"].split(";")[0].removeprefix("engine=")

            def second_knows() -> bool:
                table, _ = call(second.url, "/debug/route", chat(document + "two"))
                row = next(c for c in table["candidates"] if c["engine"] == engine)
                return row["overlap_exact_tokens"] == 0 and row["overlap_approx_tokens"] >= 300

            assert wait_until(second_knows, 5.0, step=0.5)
            _, headers = call(second.url, "/v1/chat/completions", chat(document + "three"))
            assert headers["x-kvmesh-route"].startswith(f"engine={engine};")
        finally:
            mesh.stop()


def test_a_replica_counts_requests_another_replica_has_in_flight(fleet, secret_file):
    """Replica B polls engine metrics only once an hour (a poll of its during the stall would show the four requests
    running until its next one); what it knows of A's load comes from A's reports."""
    ports = [free_udp_port() for _ in range(2)]
    seeds = [f"127.0.0.1:{p}" for p in ports]
    sender = RouterProcess(fleet.urls, mesh_bind=seeds[0], seeds=seeds[1], mesh_secret_file=secret_file,
                           metrics_interval=0.2)
    watcher = RouterProcess(fleet.urls, mesh_bind=seeds[1], seeds=seeds[0], mesh_secret_file=secret_file,
                            metrics_interval=3600)
    with sender, watcher:
        assert wait_until(lambda: len(call(watcher.url, "/admin/mesh")[0]["members"]) == 2, 10)

        def depth() -> int:
            table, _ = call(watcher.url, "/debug/route", chat("how busy is everyone"))
            return sum(row["queue_depth"] for row in table["candidates"])

        assert depth() == 0
        for url in fleet.urls:
            call(url, "/sim/fault", {"stall": 8.0})
        results: list[int] = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            len(call(sender.url, "/v1/chat/completions", chat(f"held request {i}"))[0]["choices"])))
            for i in range(4)]
        for thread in threads:
            thread.start()
        try:
            assert wait_until(lambda: depth() == 4, 6.0, step=0.5), depth()
        finally:
            for thread in threads:
                thread.join(30)
        assert results == [1, 1, 1, 1]
        assert wait_until(lambda: depth() == 0, 6.0, step=0.5), depth()
