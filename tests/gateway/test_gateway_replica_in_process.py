"""A whole replica, background tasks included, run in process on trio's mock clock against simulated engines
reached over memory streams: the composition root (``build_replica`` / ``run_replica``) and its seams."""

from __future__ import annotations

import json

import trio
import trio.testing
import zmq
from router_inprocess import call

from autoscale.config import AutoscaleConfig
from autoscale.offers import Offer
from autoscale.providers.base import Provider, ProvisionedEngine
from gateway.config import EngineConfig, MeshConfig, RouterConfig
from gateway.replica import build_replica, run_replica
from sim.config import EngineConfig as SimEngineConfig
from sim.engine import SimEngine
from sim.http_server import serve_connection
from sim.tokenizer import SimTokenizer

MODEL = "kvmesh-tiny"


class InMemoryEngines:
    """Simulated engines named ``sim-N`` (port 8000), answering on memory streams instead of sockets."""

    def __init__(self) -> None:
        self.engines: dict[str, SimEngine] = {}
        self.connections: dict[str, int] = {}
        self._tokenizer = SimTokenizer(SimEngineConfig().tokenizer)
        self._zmq = zmq.Context()
        self._nursery: trio.Nursery | None = None

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def start(self, name: str) -> str:
        assert self._nursery is not None
        engine = SimEngine(SimEngineConfig(events=False, profile="fast"), self._tokenizer, self._zmq)
        await self._nursery.start(engine.run_without_network)
        self.engines[name] = engine
        return f"http://{name}:8000"

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """The router's pools connect here: a fresh memory stream pair, the engine serving one end."""
        engine = self.engines.get(host)
        if engine is None or self._nursery is None:
            raise OSError(f"no engine {host}")
        client, server = trio.testing.memory_stream_pair()
        self.connections[host] = self.connections.get(host, 0) + 1
        self._nursery.start_soon(serve_connection, server, engine.handle, 5.0)
        return client


class InMemoryProvider(Provider):
    name = "in-memory"

    def __init__(self, engines: InMemoryEngines) -> None:
        super().__init__()
        self.engines = engines
        self.started: list[str] = []

    async def _provision(self, request_id, offer, term):
        name = f"sim-auto-{len(self.started)}"
        self.started.append(name)
        return ProvisionedEngine(name, await self.engines.start(name), offer.name)

    async def terminate(self, engine_id, term):
        self.engines.engines.pop(engine_id, None)

    async def list(self, term):
        return []


async def wait_until(predicate, limit_s: float = 120.0) -> None:
    with trio.fail_after(limit_s):  # mock-clock seconds
        while not predicate():
            await trio.sleep(0.1)


async def ask(router, text: str) -> int:
    """One chat request from a client that stays connected until the answer is complete; its status."""
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    statuses = []

    async def receive():
        if messages:
            return messages.pop()
        await trio.sleep_forever()

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await router(scope, receive, send)
    return statuses[0]


def tasks_below(task: trio.lowlevel.Task) -> int:
    return sum(1 + tasks_below(child) for nursery in task.child_nurseries for child in nursery.child_tasks)


async def test_a_replica_runs_in_process_on_a_mock_clock(autojump_clock):
    engines = InMemoryEngines()
    provider = InMemoryProvider(engines)
    offer = Offer("sim", price_per_hour=1.0, capacity=4, provisioning_s=0)
    config = RouterConfig(
        engines=[EngineConfig(url="http://sim-0:8000", id="sim-0")], policy="least_loaded", metrics_interval_s=0.5,
        autoscaler=AutoscaleConfig(enabled=True, interval_s=1.0, min_engines=2, max_engines=2, offers=[offer]))
    me = trio.lowlevel.current_task()
    async with trio.open_nursery() as root:
        await root.start(engines.run)
        await engines.start("sim-0")
        replica = build_replica(config, connect=engines.connect, provider=provider)
        fleet = replica.fleet
        await root.start(run_replica, replica)

        # The autoscaler provisions up to min_engines=2, and what it started lands in the same fleet.
        await wait_until(lambda: provider.started and fleet.engines.get(provider.started[0]) is not None
                         and fleet.engines.get(provider.started[0]).routable)
        assert fleet.engines.get("sim-0").routable

        # Admin add starts a watcher (the engine is polled and becomes routable) and remove stops it.
        await engines.start("sim-9")
        added = await call(replica.router, "POST", "/admin/engines", json.dumps({"url": "http://sim-9:8000",
                                                                               "id": "sim-9"}).encode())
        assert added.status == 201
        await wait_until(lambda: fleet.engines.get("sim-9").routable)
        assert (await call(replica.router, "DELETE", "/admin/engines/sim-9")).status == 200
        await trio.sleep(1)
        polled = engines.engines["sim-9"].success.copy(), engines.connections["sim-9"]
        await trio.sleep(30)
        assert (engines.engines["sim-9"].success, engines.connections["sim-9"]) == polled
        assert fleet.engines.get("sim-9") is None

        # Requests are served through the memory streams; failures open sim-0's breaker, and moving the clock
        # past the open period half-opens it.
        assert await ask(replica.router, "hello") == 200
        sim0 = fleet.engines.get("sim-0")
        engines.engines["sim-0"].faults.fail_rate = 1.0
        breaker = sim0.health.breaker
        while breaker.state != "open":
            await ask(replica.router, "fail")
        opened_at = trio.current_time()
        assert not sim0.routable and breaker.state_at(opened_at) == "open"
        await trio.sleep(breaker.open_until - opened_at + 0.01)
        assert breaker.state_at(trio.current_time()) == "half_open" and sim0.routable

        assert tasks_below(me) > 10
        root.cancel_scope.cancel()
    assert tasks_below(me) == 0


async def test_a_meshed_replica_scrapes_its_mesh_counters(tmp_path):
    """The composition root registers the mesh's counters on the router's /metrics (built, not run)."""
    secret = tmp_path / "secret"
    secret.write_text("a" * 16 + "-in-process-test-secret")
    config = RouterConfig(engines=[EngineConfig(url="http://sim-0:8000", id="sim-0")],
                          mesh=MeshConfig(bind="127.0.0.1:0", secret_file=str(secret)))
    replica = build_replica(config)
    assert replica.mesh is not None
    replica.mesh.protocol.on_frame(b"\xc1", 0.0)
    page = replica.metrics.render().decode()
    assert 'kvmesh_mesh_events_total{event="malformed",layer="protocol"} 1.0' in page
    assert 'kvmesh_mesh_values_rejected_total{namespace="document"} 0.0' in page
