"""Per-engine circuit breaker and the combined health verdict the router filters candidates by (sans-IO).

Breaker: closed until ``failure_threshold`` consecutive failures, or an error rate of at least
``error_rate_threshold`` over the last ``window`` requests (judged only once the window is full, so one
early failure cannot open it). Open for ``open_base_s``, doubling on every re-open up to ``open_max_s``;
then half-open: up to ``half_open_probes`` requests go through. A probe's success closes the breaker and
resets the backoff; its failure re-opens it with the doubled backoff. A probe whose outcome is never
recorded (client gone, task cancelled) frees its slot after ``probe_timeout_s``, so the breaker cannot
stick half-open. An outcome that says nothing about the engine (``abstain``: the request was at fault,
the engine was busy or is still generating) frees its slot at once and moves nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

State = Literal["closed", "half_open", "open"]
_STATE_CODES: dict[State, int] = {"closed": 0, "half_open": 1, "open": 2}
_MAX_DOUBLINGS = 32


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 5, error_rate_threshold: float = 0.5, window: int = 20,
                 open_base_s: float = 1.0, open_max_s: float = 30.0, half_open_probes: int = 1,
                 probe_timeout_s: float = 30.0) -> None:
        self.failure_threshold = failure_threshold
        self.error_rate_threshold = error_rate_threshold
        self.open_base_s = open_base_s
        self.open_max_s = open_max_s
        self.half_open_probes = half_open_probes
        self.probe_timeout_s = probe_timeout_s
        self.state: State = "closed"
        self.open_until = 0.0
        self.open_for = 0.0
        self.last_cause: str | None = None
        self.opens = 0
        self._failures: deque[bool] = deque(maxlen=window)
        self._consecutive = 0
        self._probes: list[float] = []

    def _advance(self, now: float) -> None:
        if self.state == "open" and now >= self.open_until:
            self.state = "half_open"
            self._probes = []
        if self.state == "half_open":
            self._probes = [t for t in self._probes if now - t < self.probe_timeout_s]

    def state_at(self, now: float) -> State:
        """The state the breaker is in at ``now`` (an open period may have ended), read without changing it."""
        return "half_open" if self.state == "open" and now >= self.open_until else self.state

    def available(self, now: float) -> bool:
        """Whether ``allow`` would let a request through now, without taking a probe slot. A read: it changes
        nothing, so health can be asked at any time (and on a mock clock) without moving the breaker."""
        state = self.state_at(now)
        if state == "half_open":
            live = 0 if self.state == "open" else sum(now - t < self.probe_timeout_s for t in self._probes)
            return live < self.half_open_probes
        return state == "closed"

    def allow(self, now: float) -> bool:
        """Call once for the engine actually chosen: in half-open this takes one of the probe slots."""
        self._advance(now)
        if not self.available(now):
            return False
        if self.state == "half_open":
            self._probes.append(now)
        return True

    def probe_now(self, now: float) -> None:
        """Outside evidence says the engine is back: end the open period so probes can confirm it."""
        if self.state == "open":
            self.open_until = now
            self._advance(now)

    def record_success(self, now: float) -> None:
        self._advance(now)
        if self.state == "half_open":
            self.state = "closed"
            self.opens = 0
            self._failures.clear()
            self._probes = []
        elif self.state == "closed":
            self._failures.append(False)
            self._consecutive = 0

    def record_failure(self, now: float, cause: str) -> None:
        """Late outcomes of requests sent before the breaker opened change nothing while it is open."""
        self._advance(now)
        if self.state == "open":
            return
        self.last_cause = cause
        if self.state == "half_open":
            self._open(now)
            return
        self._failures.append(True)
        self._consecutive += 1
        window_full = len(self._failures) == self._failures.maxlen
        too_many = window_full and sum(self._failures) >= self.error_rate_threshold * len(self._failures)
        if self._consecutive >= self.failure_threshold or too_many:
            self._open(now)

    def abstain(self, now: float) -> None:
        """An outcome that says nothing about the engine (the request was at fault, the engine was busy,
        or it is still generating): frees the half-open probe slot it took and moves nothing else."""
        self._advance(now)
        if self.state == "half_open" and self._probes:
            self._probes.pop()

    def _open(self, now: float) -> None:
        self.opens += 1
        self.open_for = min(self.open_max_s, self.open_base_s * 2 ** min(self.opens - 1, _MAX_DOUBLINGS))
        self.open_until = now + self.open_for
        self.state = "open"
        self._failures.clear()
        self._consecutive = 0
        self._probes = []

    def state_code(self, now: float | None = None) -> int:
        """For a Prometheus gauge: 0 closed, 1 half-open, 2 open (as of ``now`` when given)."""
        return _STATE_CODES[self.state if now is None else self.state_at(now)]


class EngineHealth:
    """One verdict from four signals: request outcomes (the breaker), ``/health`` polls, ``/metrics`` polls
    and faults of the engine's own background tasks.

    Not routable: before the first successful ``/health`` poll, after ``health_failures_down``
    consecutive failed polls, while the breaker refuses, or while a background task of the engine fails.
    Failing metric polls leave it routable with a reason: a missing scrape only makes the load estimate
    older. KV-event silence is deliberately not a health signal: events can lag because the router
    itself defers ingest under load, so silence lowers the index's confidence in the engine
    (index/freshness.py) and never takes the engine out of rotation.
    """

    def __init__(self, breaker: CircuitBreaker | None = None, health_failures_down: int = 2,
                 metric_failures_down: int = 3) -> None:
        self.breaker = breaker or CircuitBreaker()
        self.prefill_breaker = CircuitBreaker()
        """Failed prefill legs of a disaggregated fleet, when the engine also decodes (they must not keep
        its decode traffic away); it goes with the engine's state when the engine is removed."""
        self.health_failures_down = health_failures_down
        self.metric_failures_down = metric_failures_down
        self.health_checked = False
        self.was_down = False
        """The last successful poll ended a down period (a restart, a pause): what was learned is stale."""
        self.health_failures = 0
        self.metric_failures = 0
        self.last_error = ""
        self.faults: dict[str, str] = {}
        """Background tasks of this engine that are failing (task -> what went wrong): not routable."""

    def record_health(self, ok: bool, detail: str = "", now: float | None = None) -> None:
        """A /health poll. When it comes back after the engine was down, an open breaker moves to half-open
        at once: a restarted engine must rejoin within a second, not after the breaker's backoff."""
        if ok:
            self.was_down = self.health_failures >= self.health_failures_down
            if self.was_down and now is not None:
                self.breaker.probe_now(now)
            self.health_checked = True
            self.health_failures = 0
        else:
            self.health_failures += 1
            self.last_error = detail

    def record_fault(self, task: str, detail: str) -> None:
        """One of the engine's own tasks (discovery, health, metrics) broke on what the engine sent."""
        self.faults[task] = detail

    def clear_fault(self, task: str) -> None:
        self.faults.pop(task, None)

    def record_metrics(self, ok: bool, detail: str = "") -> None:
        if ok:
            self.metric_failures = 0
        else:
            self.metric_failures += 1
            self.last_error = detail

    def status(self, now: float) -> tuple[bool, str]:
        """(routable, reason); the reason is "ok" or names the failing signal(s)."""
        if self.health_failures >= self.health_failures_down:
            return False, f"health check failed {self.health_failures} times ({self.last_error})"
        if self.faults:
            return False, "; ".join(f"{task} failing: {detail}" for task, detail in sorted(self.faults.items()))
        if not self.health_checked:
            return False, "awaiting first health check"
        if not self.breaker.available(now):
            state = self.breaker.state_at(now).replace("_", "-")
            return False, f"circuit {state} after {self.breaker.last_cause}"
        if self.metric_failures >= self.metric_failures_down:
            return True, f"metrics failing ({self.last_error})"
        return True, "ok"

    def routable(self, now: float) -> bool:
        return self.status(now)[0]

    def reason(self, now: float) -> str:
        return self.status(now)[1]
