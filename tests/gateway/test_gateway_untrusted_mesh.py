"""A meshed fleet meets every bad engine and a poisoned Redis: each replica keeps serving the good engine.

Three router replicas (real processes, meshed, Redis on) front one simulated engine while a client sends
requests through every replica. Engines are added in turn through one replica's admin API, so the
registry replicates each to all three: one whose /v1/models says ``{"data": null}``, one announcing a
surrogate event topic, one claiming 1e308 KV blocks (and answering chat, so it stays routable), and a
non-ASCII URL (refused at the door). A fourth replica starts on a Redis snapshot that was forged.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest
import redis
import trio
from gateway_http import MODEL
from test_gateway_untrusted_engines import LIAR, MODELS, SOURCES_SURROGATE
from untrusted_engines import HEALTHY, serve_canned

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess
from mesh.snapshots import KEY_PREFIX

pytestmark = [pytest.mark.mesh, pytest.mark.integration]

BAD = {"models-null": {**HEALTHY, "/v1/models": b'{"object": "list", "data": null}'},
       "sources-surrogate": {**HEALTHY, "/v1/models": MODELS, "/kv_event_sources": SOURCES_SURROGATE},
       "liar": LIAR}


def post(url: str, body: dict, timeout: float = 30.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def get(url: str, timeout: float = 10.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


class CannedEngines:
    """The bad engines, served from a thread of their own for the test's duration."""

    def __init__(self) -> None:
        self.ports: dict[str, int] = {}
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._serve,), daemon=True)

    async def _serve(self) -> None:
        self._stop, self._token = trio.Event(), trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            for name, answers in BAD.items():
                self.ports[name] = await nursery.start(serve_canned, answers)
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def __enter__(self) -> CannedEngines:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self._token is not None and self._stop is not None
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(10)


class Load:
    """Chat requests through every replica, one at a time, until stopped; failures are kept."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.sent = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            url = self.urls[self.sent % len(self.urls)]
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {self.sent}"}],
                    "max_tokens": 2}
            try:
                status, answer = post(url + "/v1/chat/completions", body)
            except OSError as exc:
                status, answer = 0, repr(exc).encode()
            if status != 200:
                self.failures.append(f"{url}: {status} {answer[:200]!r}")
            self.sent += 1

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def test_bad_engines_and_a_forged_snapshot_never_cost_a_request(tmp_path, redis_server):
    redis_url, _ = redis_server
    secret_file = tmp_path / "mesh.secret"
    secret_file.write_text(os.urandom(24).hex())
    seeds_ports = []
    routers: list[RouterProcess] = []
    with SimFleetProcess(engines=1, profile="fast") as sims, CannedEngines() as bad:
        try:
            for _ in range(3):
                routers.append(RouterProcess(
                    sims.urls, mesh_bind="127.0.0.1:0",
                    seeds=",".join(seeds_ports), mesh_secret_file=str(secret_file), redis_url=redis_url,
                    metrics_interval=0.2).start())
                mesh = json.loads(urllib.request.urlopen(routers[-1].url + "/admin/mesh", timeout=10).read())
                seeds_ports.append(mesh["members"][0]["gossip_addr"])
            with Load([r.url for r in routers]) as load:
                for name, port in bad.ports.items():
                    status, body = post(routers[0].url + "/admin/engines", {"url": f"http://127.0.0.1:{port}"})
                    assert status == 201, (name, body)
                    time.sleep(3)
                status, body = post(routers[1].url + "/admin/engines", {"url": "http://\u00fc@127.0.0.1:9"})
                assert status == 400, body
                client = redis.Redis.from_url(redis_url)
                client.hset(KEY_PREFIX + "kvmesh", mapping={"format": b"2", "epoch_number": str(2**64).encode(),
                                                             "full": b"\xff" * 64, "mac": b"0" * 64})
                client.close()
                late = RouterProcess(sims.urls, mesh_bind="127.0.0.1:0", seeds=",".join(seeds_ports),
                                     mesh_secret_file=str(secret_file), redis_url=redis_url,
                                     metrics_interval=0.2).start()
                routers.append(late)
                load.urls.append(late.url)
                time.sleep(5)
            assert load.sent > 20
            assert load.failures == []
            for router in routers:
                assert router.alive(), router.stderr()[-2000:]
                assert get(router.url + "/ready") == 200
                engines = json.loads(urllib.request.urlopen(router.url + "/admin/engines", timeout=10).read())
                urls = {e["url"] for e in engines["engines"]}
                assert {f"http://127.0.0.1:{p}" for p in bad.ports.values()} <= urls
        finally:
            for router in routers:
                router.stop()
