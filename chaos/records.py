"""Plain data a chaos run collects: one record per request, per fault action and per monitor sample.

Times are seconds since the start of the run, on one clock (the runner's), so the invariant checks can
line requests up against faults without any I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.stats import RequestResult

# Request errors as the load generator sees them ("" = success).
TRANSPORT = "transport"
TIMEOUT = "timeout"
SSE_ERROR = "sse_error"
INCOMPLETE = "incomplete"
MALFORMED = "malformed"
SHORT = "short"
"""A stream whose usage counts fewer tokens than asked for (the simulated engines always generate them all)."""

# Fault actions.
KILL = "kill"
STOP = "stop"
PAUSE = "pause"
RESUME = "resume"
RESTART = "restart"
ISOLATE = "isolate"
REJOIN_MESH = "rejoin_mesh"
DROP_EVENTS = "drop_events"
RESUME_EVENTS = "resume_events"
ENDS_PROCESS = frozenset({KILL, STOP})


@dataclass
class RequestRecord:
    """One request through the load balancer; ``first_byte`` is None when no body byte arrived."""

    index: int
    start: float
    end: float = 0.0
    first_byte: float | None = None
    first_token: float | None = None
    status: int = 0
    engine: str = ""
    error: str = ""
    detail: str = ""
    stream: bool = True
    tenant: str = ""
    """The tenant whose key the request carried (empty on a cluster without auth)."""
    token_times: list[float] = field(default_factory=list)
    """When each content chunk of a stream arrived: a continued stream shows the kill-to-next-token wait."""

    @property
    def ok(self) -> bool:
        return not self.error and self.status == 200

    def as_result(self) -> RequestResult:
        """The bench form, so latency summaries reuse ``bench.stats``."""
        return RequestResult(
            started=self.start, status=self.status, total=self.end - self.start, route=self.engine,
            ttft=None if self.first_token is None else self.first_token - self.start,
            error=self.error,
        )


@dataclass
class FaultAction:
    """One thing done to the cluster: ``at`` when it began, ``done_at`` when it took effect.

    For a restart ``done_at`` is when the new process answered its health check. ``engine_id`` is the
    id routers use for an engine (``host:port``), empty for other roles.
    """

    event: int
    fault: str
    action: str
    role: str
    target: str
    at: float
    done_at: float
    ok: bool = True
    detail: str = ""
    pid: int = 0
    engine_id: str = ""


@dataclass
class ProcessSample:
    pid: int
    alive: bool
    rss_kb: int = 0
    fds: int = 0


@dataclass(frozen=True)
class AutoscalerView:
    """One router's ``/admin/autoscaler``: whether it acts now, under which lease term, and who it is."""

    acting: bool
    term: int
    me: str


@dataclass(frozen=True)
class PoolView:
    """The standby pool's record: provisions made and the request id of each."""

    provisions: int
    requests: tuple[str, ...]


@dataclass
class Sample:
    """What the monitor saw in one round: process stats, each router's index fingerprint (None when it
    did not answer) and each engine's prefix-cache counters (None when it did not answer); on a cluster
    with an autoscaler, each router's autoscaler view (None when it did not answer) and the pool's record."""

    t: float
    processes: dict[str, ProcessSample] = field(default_factory=dict)
    indexes: dict[str, dict[str, str] | None] = field(default_factory=dict)
    counters: dict[str, dict[str, float] | None] = field(default_factory=dict)
    autoscaler: dict[str, AutoscalerView | None] = field(default_factory=dict)
    pool: PoolView | None = None
