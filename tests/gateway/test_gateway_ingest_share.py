"""A replica's loop-lag readings move its ingest share, and the share it allows is exported."""

from __future__ import annotations

from gateway.config import EngineConfig, RouterConfig
from gateway.replica import build_replica


def _share(replica) -> float:
    return replica.metrics.registry.get_sample_value("kvmesh_ingest_share")


async def test_lag_readings_set_the_exported_ingest_share() -> None:
    """Async: the replica reads trio's clock."""
    replica = build_replica(RouterConfig(engines=[EngineConfig(url="http://127.0.0.1:9", id="e")]))
    replica.router.active_requests = 1  # serving: the share follows the readings
    for _ in range(20):
        replica.observe_loop_lag(0.001)
    assert _share(replica) == replica.ingest.budget.idle_share
    replica.observe_loop_lag(0.06)
    assert _share(replica) == replica.ingest.budget.idle_share / 2
    for _ in range(5):
        replica.observe_loop_lag(0.08)
    assert _share(replica) == replica.ingest.budget.share
    replica.router.active_requests = 0
    replica.observe_loop_lag(0.05)
    assert _share(replica) == replica.ingest.budget.idle_share  # nothing served: the loop's idle share
