"""Every autoscaler task has an owner that catches, logs once, counts and goes on.

A provider is untrusted (a user's executable, a cloud API) and the replicated document is written by
peers: an exception that left one of the autoscaler's tasks would end its nursery and the router with
it, and after a takeover the next holder's too. ``TaskFaults`` is the sans-IO part (one episode per
task: the first failure is logged with its traceback, every failure is counted by task and exception
type, the retry delay doubles); :func:`supervise` reruns a loop after the delay, :func:`guarded` runs a
one-shot task once and reports whether it finished.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger("kvmesh.autoscaler")

BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 30.0


class TaskFaults:
    """Consecutive failures per task since its last success; ``counter`` is a Prometheus counter labelled
    ``task`` and ``reason``."""

    def __init__(self, counter: Any, base_s: float = BACKOFF_BASE_S, max_s: float = BACKOFF_MAX_S) -> None:
        self.counter = counter
        self.base_s = base_s
        self.max_s = max_s
        self.failing: dict[str, int] = {}

    def failed(self, task: str, exc: BaseException) -> float:
        """Record a failure; returns how long to wait before retrying."""
        count = self.failing.get(task, 0)
        self.failing[task] = count + 1
        reason = type(exc).__name__
        self.counter.labels(task, reason).inc()
        if count == 0:
            log.error("autoscaler task failed; going on", exc_info=exc, extra={"task": task, "reason": reason})
        return min(self.max_s, self.base_s * 2 ** min(count, 32))

    def succeeded(self, task: str) -> None:
        if self.failing.pop(task, 0):
            log.info("autoscaler task recovered", extra={"task": task})


async def supervise(faults: TaskFaults, task: str, run: Callable[[], Awaitable[None]]) -> None:
    """Run ``run()`` until it returns; whatever it raises (but cancellation) is counted and it is rerun
    after the backoff."""
    while True:
        try:
            await run()
            return
        except Exception as exc:  # a provider or a peer's value must never end the router
            delay = faults.failed(task, exc)
        await trio.sleep(delay)


async def guarded(faults: TaskFaults, task: str, run: Callable[[], Awaitable[None]]) -> bool:
    """Run a one-shot task; False (counted, logged once) when it raised."""
    try:
        await run()
    except Exception as exc:  # as in supervise
        faults.failed(task, exc)
        return False
    faults.succeeded(task)
    return True
