"""Gauges carry only engines that exist: a removed engine's series disappear at the next scrape."""

from __future__ import annotations

import trio

from gateway.config import EngineConfig, RouterConfig
from gateway.replica import build_replica


async def test_removed_engine_leaves_no_gauge_series_behind():
    router = build_replica(RouterConfig(engines=[EngineConfig(url="http://127.0.0.1:9"),
                                                 EngineConfig(url="http://127.0.0.1:10")])).router
    page = router.metrics.render().decode()
    assert 'kvmesh_engine_healthy{engine="127.0.0.1:10"}' in page
    router.fleet.remove("127.0.0.1:10", replicate=False)
    page = router.metrics.render().decode()
    assert 'engine="127.0.0.1:10"' not in page
    assert 'kvmesh_engine_healthy{engine="127.0.0.1:9"}' in page
    await trio.sleep(0)
