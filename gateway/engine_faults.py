"""Failure episodes of an engine's background tasks: counted, logged once, backed off, retried.

An engine is untrusted input, and its watcher tasks run in the router's process-wide nursery: an
exception that left one of them would end the process. Every per-engine task therefore runs under
:func:`supervise`, which catches everything but cancellation. ``EngineFaults`` is the sans-IO part:
it decides what to log and how long to wait, and keeps the engine out of rotation while a task fails.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from events.counters import ENGINE_TASK_FAILURES
from gateway.breaker import EngineHealth

log = logging.getLogger("kvmesh.engines")

BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 30.0


class EngineFaults:
    """Per task of one engine: consecutive failures since the last success (one episode).

    The first failure of an episode is logged with its traceback; every failure is counted with its
    reason (the exception type); the retry delay doubles per failure up to ``max_s``.
    """

    def __init__(self, engine_id: str, health: EngineHealth, base_s: float = BACKOFF_BASE_S,
                 max_s: float = BACKOFF_MAX_S) -> None:
        self.engine_id = engine_id
        self.health = health
        self.base_s = base_s
        self.max_s = max_s
        self.failing: dict[str, int] = {}

    def failed(self, task: str, exc: BaseException) -> float:
        """Record a failure; returns how long to wait before retrying."""
        count = self.failing.get(task, 0)
        self.failing[task] = count + 1
        reason = type(exc).__name__
        ENGINE_TASK_FAILURES.labels(engine=self.engine_id, task=task, reason=reason).inc()
        self.health.record_fault(task, f"{reason}: {exc}"[:200])
        if count == 0:
            log.error("engine task failed; retrying with backoff", exc_info=exc,
                      extra={"engine": self.engine_id, "task": task, "reason": reason})
        return min(self.max_s, self.base_s * 2 ** min(count, 32))

    def succeeded(self, task: str) -> None:
        """The task did its job once: the episode (if any) is over."""
        if self.failing.pop(task, 0):
            self.health.clear_fault(task)
            log.info("engine task recovered", extra={"engine": self.engine_id, "task": task})


async def supervise(faults: EngineFaults, task: str, run: Callable[[], Awaitable[None]]) -> None:
    """Run ``run()`` until it returns; whatever it raises (but cancellation) is counted and it is rerun after
    the backoff. ``run`` reports its own progress with ``faults.succeeded(task)``."""
    while True:
        try:
            await run()
            return
        except Exception as exc:  # an engine's answers are untrusted: nothing they cause may end the router
            delay = faults.failed(task, exc)
        await trio.sleep(delay)
