"""How much of the event loop KV-event work may take (sans-IO: time passed in).

A router replica serves requests and ingests every engine's events on one trio loop. Unbounded, a
busy fleet's events took a whole core: requests waited seconds and the router's own health polls of
the engines timed out, so healthy engines were marked down (an outage caused by the router being late,
not the engine). Ingest therefore runs in short slices charged to one token bucket per process, refilled
at ``idle_share`` seconds of work per second while the loop has headroom, and at ``share`` while it does
not. Headroom: no request is in flight, or the loop's own lag (gateway/loop_lag.py) stayed on time, since
every ready request waits about as long as the loop runs late. Keying on "a request is in flight" alone
capped ingest at 0.3 of the loop under light continuous traffic, however idle the loop was (70k block
ops/s on a replica that had most of a core free); keying on the lag alone starved ingest on a machine with
no core free, where the lag is the machine's (6.5k of 10k block ops/s applied in a window without chat).
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
    """Fraction of wall time event work may use while the loop runs late."""
    idle_share: float = 0.9
    """Fraction it may use while the loop has headroom."""
    burst_s: float = 0.003
    """Work allowed at once after an idle spell; also the longest a request waits behind ingest per tick."""
    slice_s: float = 0.001
    """Work done between two yields to the scheduler."""
    serving: Callable[[], bool] = field(default=_always_serving, repr=False)
    """Whether requests are in flight now (the router's count; always, when nobody says)."""
    lag_target_s: float = 0.005
    """Loop lag above this means no headroom: requests already wait on the loop."""
    hold_s: float = 1.0
    """After a lag above target, the lower share holds this long."""
    fresh_s: float = 0.25
    """Lag readings older than this do not vouch for headroom (nobody watching: the lower share)."""
    lagged_at: float = -math.inf
    observed_at: float = -math.inf
    tokens: float = 0.003
    updated_at: float | None = None

    def __post_init__(self) -> None:
        if not (0 < self.share <= 1 and 0 < self.idle_share <= 1) or self.burst_s <= 0 or self.slice_s <= 0:
            raise ValueError("ingest budget: shares in (0, 1], positive burst and slice")
        self.tokens = self.burst_s

    def observe_lag(self, now: float, lag_s: float) -> None:
        """The loop woke ``lag_s`` late at ``now`` (fed by the loop-lag watcher)."""
        self.observed_at = now
        if lag_s > self.lag_target_s:
            self.lagged_at = now

    def headroom(self, now: float) -> bool:
        """Whether no request waits, or the loop recently ran on time as seen by fresh lag readings."""
        if not self.serving():
            return True
        return now - self.observed_at <= self.fresh_s and now - self.lagged_at >= self.hold_s

    def _rate(self, now: float) -> float:
        return self.idle_share if self.headroom(now) else self.share

    def _refill(self, now: float) -> None:
        if self.updated_at is not None and now > self.updated_at:
            self.tokens = min(self.burst_s, self.tokens + (now - self.updated_at) * self._rate(now))
        self.updated_at = now if self.updated_at is None else max(now, self.updated_at)

    def wait_s(self, now: float) -> float:
        """Seconds to wait before the next slice (0: go ahead). The time ingest actually waited is counted where
        it waits (``kvmesh_event_ingest_deferred_seconds_total``, events/socket_drain.py): a wait asked again after
        a sleep would count twice here."""
        self._refill(now)
        if self.tokens > 0:
            return 0.0
        return -self.tokens / self._rate(now) + 1e-4

    def charge(self, now: float, spent_s: float) -> None:
        """Work of ``spent_s`` seconds was done; the bucket may go negative (a slice overran)."""
        self._refill(now)
        self.tokens -= max(0.0, spent_s)
