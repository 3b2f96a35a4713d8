"""How much of the event loop KV-event work may take (sans-IO: time passed in).

A router replica serves requests and ingests every engine's events on one trio loop. Unbounded, a
busy fleet's events took a whole core: requests waited seconds and the router's own health polls of
the engines timed out, so healthy engines were marked down (an outage caused by the router being late,
not the engine). Ingest therefore runs in short slices charged to one token bucket per process, refilled
at ``idle_share`` seconds of work per second while no request is in flight, and otherwise at what the
loop's requests leave: one minus serving's share of the loop (the time it was neither waiting for I/O nor
ingesting, gateway/loop_idle.py) minus ``reserve``, between ``share`` and ``idle_share``. Keying on "a request is
in flight" alone capped ingest at 0.3 of the loop under light continuous traffic, however idle the loop was
(70k block ops/s on a replica that had most of a core free); keying on the loop's lag (the lower share
whenever a wake-up came more than 5 ms late in the last second) starved it under chat: at 150k block ops/s
with chat probes for 60 s, a replica whose loop lag p99 was 50 ms and which waited for a core 8% of the time
kept ingest at 0.3 of the loop, its subscribers' deferrals added up to 541 s, and it fell 32 s behind.
When the bucket is empty, subscribers wait: messages queue in ZMQ (and past its high-water mark are
dropped there, which the seq tracker sees as a gap to replay or count lost) and the engine's confidence
falls, so routing leans on load until ingest catches up. ``burst_s`` bounds how long a request can wait
behind ingest in one pass of the scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


def _always_serving() -> bool:
    return True


@dataclass(slots=True)
class IngestBudget:
    share: float = 0.3
    """Least fraction of wall time event work may use while requests are served."""
    idle_share: float = 0.9
    """Most it may use, and what it uses while no request is in flight."""
    burst_s: float = 0.003
    """Work allowed at once after an idle spell; also the longest a request waits behind ingest per tick."""
    slice_s: float = 0.001
    """Work done between two yields to the scheduler."""
    serving: Callable[[], bool] = field(default=_always_serving, repr=False)
    """Whether requests are in flight now (the router's count; always, when nobody says)."""
    reserve: float = 0.1
    """Share of the loop kept free beyond what serving used, for its next burst."""
    smooth_s: float = 0.5
    """Time constant of serving's share: a request's burst does not swing ingest's rate."""
    fresh_s: float = 0.25
    """Loop readings older than this do not vouch for headroom (nobody watching: the lower share)."""
    serving_share: float = 1.0
    """Serving's recent share of the loop (wall time neither idle nor ingesting), smoothed."""
    observed_at: float = -math.inf
    idle_total_s: float = 0.0
    ingest_total_s: float = 0.0
    ingest_seen_s: float = 0.0
    tokens: float = 0.003
    updated_at: float | None = None
    deferrals: int = 0
    deferred_s: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.share <= 1 and 0 < self.idle_share <= 1) or self.burst_s <= 0 or self.slice_s <= 0:
            raise ValueError("ingest budget: shares in (0, 1], positive burst and slice")
        self.tokens = self.burst_s

    def observe_loop(self, now: float, idle_total_s: float) -> None:
        """The loop had waited for I/O with no task ready for ``idle_total_s`` in all by ``now`` (a running total):
        over the time since the last reading, what was neither idle nor ingest was serving."""
        elapsed = now - self.observed_at
        if elapsed <= 0:
            return
        if math.isfinite(elapsed):
            idle, ingest = idle_total_s - self.idle_total_s, self.ingest_total_s - self.ingest_seen_s
            serving = min(1.0, max(0.0, (elapsed - idle - ingest) / elapsed))
            weight = min(1.0, elapsed / self.smooth_s)
            self.serving_share += weight * (serving - self.serving_share)
        self.observed_at, self.idle_total_s, self.ingest_seen_s = now, idle_total_s, self.ingest_total_s

    def rate(self, now: float) -> float:
        """Seconds of ingest work allowed per second now."""
        if not self.serving():
            return self.idle_share
        if now - self.observed_at > self.fresh_s:
            return self.share
        return min(self.idle_share, max(self.share, 1.0 - self.serving_share - self.reserve))

    def _refill(self, now: float) -> None:
        if self.updated_at is not None and now > self.updated_at:
            self.tokens = min(self.burst_s, self.tokens + (now - self.updated_at) * self.rate(now))
        self.updated_at = now if self.updated_at is None else max(now, self.updated_at)

    def wait_s(self, now: float) -> float:
        """Seconds to wait before the next slice (0: go ahead); a positive answer counts as a deferral."""
        self._refill(now)
        if self.tokens > 0:
            return 0.0
        wait = -self.tokens / self.rate(now) + 1e-4
        self.deferrals += 1
        self.deferred_s += wait
        return wait

    def charge(self, now: float, spent_s: float) -> None:
        """Work of ``spent_s`` seconds was done; the bucket may go negative (a slice overran)."""
        self._refill(now)
        self.tokens -= max(0.0, spent_s)
        self.ingest_total_s += max(0.0, spent_s)
