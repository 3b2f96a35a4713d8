"""The loop's actions on a fleet stand-in: provisioned engines are registered, a released engine is
drained first and only terminated once idle."""

from types import SimpleNamespace

import numpy as np
import trio

from autoscale.config import AutoscaleConfig
from autoscale.loop import AutoscaleLoop
from autoscale.offers import Offer
from autoscale.providers.base import Provider, ProvisionedEngine
from gateway.autoscale_link import RouterSignals
from gateway.config import EngineConfig
from gateway.engines import EngineRegistry
from gateway.metrics import RouterMetrics


class FakeProvider(Provider):
    name = "fake"

    def __init__(self) -> None:
        super().__init__()
        self.terminated: list[str] = []
        self.started = 0

    async def _provision(self, request_id, offer):
        self.started += 1
        return ProvisionedEngine(f"new-{self.started}", f"http://127.0.0.1:{9000 + self.started}", offer.name)

    async def terminate(self, engine_id):
        self.terminated.append(engine_id)

    async def list(self):
        return []


class FakeFleet:
    """``FleetControl`` over a bare engine registry, recording what it was asked; the signals come from the
    router's real reader over the same engines and a stand-in index of ``blocks``."""

    def __init__(self) -> None:
        self.engines = EngineRegistry()
        self.blocks: dict[str, dict[int, int]] = {}
        self.removed: list[str] = []
        self.signals = RouterSignals(self.engines, SimpleNamespace(export=self._export, block_count=lambda e: 0),
                                     dict, RouterMetrics().ttft, None)

    def _export(self, engine: str) -> tuple[np.ndarray, np.ndarray]:
        pairs = self.blocks.get(engine, {})
        return np.array(list(pairs), dtype=np.uint64), np.array(list(pairs.values()), dtype=np.uint64)

    def known(self, engine_id: str) -> bool:
        return self.engines.get(engine_id) is not None

    def register(self, engine_id: str, url: str, island: str | None) -> None:
        self.engines.add(EngineConfig(url=url, id=engine_id, island=island))

    def release(self, engine_id: str) -> None:
        self.removed.append(engine_id)
        self.engines.remove(engine_id)

    def drain(self, engine_id: str, handover_in_s: float) -> None:
        self.engines.get(engine_id).draining = True

    def idle(self, engine_id: str, since: float) -> bool:
        engine = self.engines.get(engine_id)
        return engine is None or (engine.in_flight == 0 and (engine.load.polled_at or 0) > since)


def autoscaler(fleet: FakeFleet, config: AutoscaleConfig) -> AutoscaleLoop:
    return AutoscaleLoop(config, fleet, fleet.signals, None, "local", RouterMetrics().registry)


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
        router.blocks["new-1"] = {11: 1, 12: 2, 13: 3}  # new-1 alone caches 1 and 2: losing new-2 costs less
        router.blocks["new-2"] = {21: 3}
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
