"""Every long-lived task has an owner that catches, logs once, counts and goes on.

Engines, providers and peers are untrusted: an exception that left one of the tasks that talk to them
would end its nursery and the router with it (for the autoscaler, after a takeover, the next holder's
too). ``TaskFaults`` is the sans-IO part (one episode per task: the first failure is logged with its
traceback, every failure is counted by task and exception type, the retry delay doubles up to a cap);
:func:`supervise` reruns a loop after the delay, :func:`guarded` runs a one-shot task once and reports
whether it finished. gateway/engine_faults.py specialises it for engine watchers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 30.0


class TaskFaults:
    """Consecutive failures per task since its last success. ``count(task, reason)`` counts one failure
    (a Prometheus counter); ``what`` names the tasks' owner in log lines, ``extra`` is added to them."""

    def __init__(self, count: Callable[[str, str], None], log: logging.Logger, what: str,
                 extra: dict[str, Any] | None = None, base_s: float = BACKOFF_BASE_S,
                 max_s: float = BACKOFF_MAX_S) -> None:
        self.count = count
        self.log = log
        self.what = what
        self.extra = extra or {}
        self.base_s = base_s
        self.max_s = max_s
        self.failing: dict[str, int] = {}

    def failed(self, task: str, exc: BaseException) -> float:
        """Record a failure; returns how long to wait before retrying."""
        count = self.failing.get(task, 0)
        self.failing[task] = count + 1
        reason = type(exc).__name__
        self.count(task, reason)
        self.on_failure(task, reason, exc)
        if count == 0:
            self.log.error(f"{self.what} task failed; retrying with backoff", exc_info=exc,
                           extra={**self.extra, "task": task, "reason": reason})
        return min(self.max_s, self.base_s * 2 ** min(count, 32))

    def succeeded(self, task: str) -> None:
        """The task did its job once: the episode (if any) is over."""
        if self.failing.pop(task, 0):
            self.on_recovery(task)
            self.log.info(f"{self.what} task recovered", extra={**self.extra, "task": task})

    def on_failure(self, task: str, reason: str, exc: BaseException) -> None:
        """What else a failure means to the owner (nothing here)."""

    def on_recovery(self, task: str) -> None:
        """What else a recovery means to the owner (nothing here)."""


async def supervise(faults: TaskFaults, task: str, run: Callable[[], Awaitable[None]]) -> None:
    """Run ``run()`` until it returns; whatever it raises (but cancellation) is counted and it is rerun after
    the backoff. ``run`` reports its own progress with ``faults.succeeded(task)``."""
    while True:
        try:
            await run()
            return
        except Exception as exc:  # the other side is untrusted: nothing it causes may end the router
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
