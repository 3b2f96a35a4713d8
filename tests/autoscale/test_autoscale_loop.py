"""The loop's actions on a fleet stand-in: provisioned engines are registered, a released engine is
drained first and only terminated once idle."""

from types import SimpleNamespace

import trio

from autoscale.config import AutoscaleConfig
from autoscale.lease import Lease
from autoscale.loop import AutoscaleLoop
from autoscale.offers import Offer
from autoscale.providers.base import Provider, ProvisionedEngine
from gateway.autoscale_link import RouterSignals
from gateway.config import EngineConfig
from gateway.engines import EngineRegistry
from gateway.metrics import RouterMetrics
from index.prefix_index import PrefixIndex


class FakeProvider(Provider):
    name = "fake"

    def __init__(self) -> None:
        super().__init__()
        self.terminated: list[str] = []
        self.started = 0

    async def _provision(self, request_id, offer, term):
        self.started += 1
        return ProvisionedEngine(f"new-{self.started}", f"http://127.0.0.1:{9000 + self.started}", offer.name)

    async def terminate(self, engine_id, term):
        self.terminated.append(engine_id)

    async def list(self, term):
        return []


class FakeFleet:
    """``FleetControl`` over a bare engine registry, recording what it was asked; the signals come from the
    router's real reader over the same engines and an index of their blocks."""

    def __init__(self, engines: EngineRegistry | None = None) -> None:
        self.engines = engines if engines is not None else EngineRegistry()
        self.index = PrefixIndex()
        self.removed: list[str] = []
        self.metrics = RouterMetrics()
        self.signals = RouterSignals(self.engines, SimpleNamespace(store=self.index, block_count=lambda e: 0),
                                     dict, RouterMetrics().ttft, None)

    def known(self, engine_id: str) -> bool:
        return self.engines.get(engine_id) is not None

    def register(self, engine_id: str, url: str, island: str | None) -> None:
        self.engines.add(EngineConfig(url=url, id=engine_id, island=island))

    def release(self, engine_id: str) -> None:
        self.removed.append(engine_id)
        self.engines.remove(engine_id)

    def drain(self, engine_id: str, handover_in_s: float) -> None:
        self.engines.get(engine_id).draining = True

    def undrain(self, engine_id: str) -> None:
        self.engines.get(engine_id).draining = False

    def idle(self, engine_id: str, since: float) -> bool:
        engine = self.engines.get(engine_id)
        return engine is None or (engine.in_flight == 0 and (engine.load.polled_at or 0) > since)


def autoscaler(fleet: FakeFleet, config: AutoscaleConfig) -> AutoscaleLoop:
    return AutoscaleLoop(config, fleet, fleet.signals, None, "local", fleet.metrics.registry)


def config(**kw) -> AutoscaleConfig:
    return AutoscaleConfig(enabled=True, offers=[Offer("o", price_per_hour=2.0, capacity=2, provisioning_s=0)],
                           cooldown_s=0, step_cooldown_s=0, down_stable_s=0, **kw)


async def test_provisions_to_min_then_drains_an_idle_engine_before_releasing(autojump_clock):
    router = FakeFleet()
    loop = autoscaler(router, config(min_engines=1))
    loop.provider = FakeProvider()
    async with trio.open_nursery() as nursery:
        loop._nursery = nursery
        loop.provider.attach(nursery)
        decision = loop.tick(1000.0)
        assert decision.action == "up" and loop.report()["pending"]
        await trio.sleep(0.1)
        assert [e.id for e in router.engines.all()] == ["new-1"] and loop.report()["managed"] == ["new-1"]
        assert not loop.report()["pending"]

        loop.tick(1001.0)  # one engine is the minimum: it stays
        loop._register("new-2", "http://127.0.0.1:9100", None, "o")
        busy = router.engines.get("new-1")
        busy.load.polled_at = trio.current_time()
        idle = router.engines.get("new-2")
        idle.in_flight = 1  # a stream in progress: the engine is drained, not released
        router.index.store("new-1", [(11, 1), (12, 2), (13, 3)])  # new-1 alone caches 1 and 2: losing new-2
        router.index.store("new-2", [(21, 3)])  # costs less
        decision = loop.tick(1002.0)
        assert decision.action == "down" and decision.release == ("new-2",)
        assert idle.draining and loop.provider.terminated == []
        await trio.sleep(5)
        assert loop.provider.terminated == [] and "new-2" in loop.draining
        idle.in_flight = 0
        idle.load.polled_at = trio.current_time()
        await trio.sleep(2)
        assert loop.provider.terminated == ["new-2"] and router.removed == ["new-2"]
        assert loop.report()["managed"] == ["new-1"] and not loop.draining
        nursery.cancel_scope.cancel()


async def test_drain_deadline_releases_a_stuck_engine(autojump_clock):
    router = FakeFleet()
    loop = autoscaler(router, config(min_engines=0, drain_deadline_s=10))
    loop.provider = FakeProvider()
    async with trio.open_nursery() as nursery:
        loop._nursery = nursery
        loop.provider.attach(nursery)
        loop._register("stuck", "http://127.0.0.1:9100", None, "o")
        loop.tick(1000.0)
        assert "stuck" in loop.draining
        await trio.sleep(9)
        assert loop.provider.terminated == []
        await trio.sleep(2)
        assert loop.provider.terminated == ["stuck"]
        nursery.cancel_scope.cancel()


class BrokenProvider(FakeProvider):
    """A provider whose failures are not ProviderError (a bug, or RecursionError from deeply nested JSON)."""

    async def terminate(self, engine_id, term):
        raise RecursionError("maximum recursion depth exceeded")

    async def list(self, term):
        raise RecursionError("maximum recursion depth exceeded")


def failures(router, task: str) -> float:
    return sum(v for (t, _), v in _samples(router, "kvmesh_autoscaler_task_failures_total").items() if t == task)


def _samples(router, name: str) -> dict:
    return {(s.labels["task"], s.labels["reason"]): s.value for metric in router.metrics.registry.collect()
            for s in metric.samples if s.name == name}


async def test_provider_surprises_and_peer_values_never_end_the_loop(autojump_clock):
    """Before, a RecursionError from list (adoption) or terminate (a drain) left its task and cancelled the
    router's nursery, and a last_change of the wrong type in the document raised out of the lease loop."""
    router = FakeFleet()
    loop = autoscaler(router, config(min_engines=0, drain_deadline_s=2))
    loop.provider = BrokenProvider()
    loop._set("state", {"last_change": [{"not": "a number"}, "up"], "pending": "x", "decisions": [{}]})
    loop._set("pending:x", {"deadline": "soon"})
    loop._set("engine:y", {"price_per_hour": [1]})
    async with trio.open_nursery() as nursery:
        loop._nursery = nursery
        loop.provider.attach(nursery)
        loop._took_over(Lease("local", 1e12, 1))
        loop._register("stuck", "http://127.0.0.1:9100", None, "o")
        loop.tick(1000.0)
        assert "stuck" in loop.draining
        await trio.sleep(5)
        assert failures(router, "adopt") == 1 and failures(router, "drain") == 1
        assert "stuck" not in loop.draining and router.engines.get("stuck") is not None
        loop._export_shared()
        nursery.cancel_scope.cancel()


async def test_a_failing_callback_of_a_ready_engine_is_counted(autojump_clock):
    router = FakeFleet()
    loop = autoscaler(router, config(min_engines=1))
    loop.provider = FakeProvider()

    def refuse(engine_id, url, island):
        raise RuntimeError("registry full")

    router.register = refuse
    async with trio.open_nursery() as nursery:
        loop._nursery = nursery
        loop.provider.attach(nursery)
        assert loop.tick(1000.0).action == "up"
        await trio.sleep(1)
        assert failures(router, "ready") == 1
        nursery.cancel_scope.cancel()


async def test_provision_ids_carry_the_term_so_no_two_processes_share_one(autojump_clock):
    first, second = autoscaler(FakeFleet(), config(min_engines=1)), autoscaler(FakeFleet(), config(min_engines=1))
    second.term = first.term + 1  # a router restarted later (without a mesh: its start time in ms)
    ids = []
    async with trio.open_nursery() as nursery:
        for loop in (first, second):
            loop.provider = FakeProvider()
            loop._nursery = nursery
            loop.provider.attach(nursery)
            loop.tick(1000.0)
            ids += loop.report()["pending"]
        nursery.cancel_scope.cancel()
    assert len(set(ids)) == 2 and ids[0].endswith(f"fake-{first.term}-1"), ids
