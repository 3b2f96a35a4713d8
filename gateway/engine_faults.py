"""Failure episodes of an engine's background tasks: counted, logged once, backed off, retried.

An engine is untrusted input, and its watcher tasks run in the router's process-wide nursery: an
exception that left one of them would end the process. Every per-engine task therefore runs under
:func:`supervise` (autoscale/supervise.py), which catches everything but cancellation. ``EngineFaults``
counts per engine and keeps the engine out of rotation while one of its tasks fails.
"""

from __future__ import annotations

import logging

from autoscale.supervise import TaskFaults, supervise
from events.counters import ENGINE_TASK_FAILURES
from gateway.breaker import EngineHealth

__all__ = ["EngineFaults", "supervise"]

log = logging.getLogger("kvmesh.engines")


class EngineFaults(TaskFaults):
    """Per task of one engine: consecutive failures since the last success (one episode)."""

    def __init__(self, engine_id: str, health: EngineHealth, **backoff: float) -> None:
        def count(task: str, reason: str) -> None:
            ENGINE_TASK_FAILURES.labels(engine=engine_id, task=task, reason=reason).inc()

        super().__init__(count, log, "engine", {"engine": engine_id}, **backoff)
        self.engine_id = engine_id
        self.health = health

    def on_failure(self, task: str, reason: str, exc: BaseException) -> None:
        self.health.record_fault(task, f"{reason}: {exc}"[:200])

    def on_recovery(self, task: str) -> None:
        self.health.clear_fault(task)
