"""``GET /admin/index`` reads every engine's blocks: its report lets the loop's other tasks run between engines."""

from __future__ import annotations

import trio

from gateway.admin import index_report
from gateway.config import EngineConfig, RouterConfig
from gateway.replica import build_replica


async def test_the_index_report_lets_other_tasks_run_between_engines():
    config = RouterConfig(engines=[EngineConfig(url=f"http://sim-{i}:8000", id=f"sim-{i}") for i in range(3)])
    replica = build_replica(config)
    store = replica.planner.cache.store
    for i in range(3):
        store.store_many(f"sim-{i}", [1, 2, 3 + i], [10 + i, 20 + i, 30 + i])
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await trio.lowlevel.checkpoint()
        before = turns
        report = await index_report(replica.fleet)
        during = turns - before
        nursery.cancel_scope.cancel()
    assert during >= 2
    assert [report["engines"][f"sim-{i}"]["blocks"] for i in range(3)] == [3, 3, 3]
