"""How much of the event loop KV-event work may take (sans-IO: time passed in).

A router replica serves requests and ingests every engine's events on one trio loop. Unbounded, a
busy fleet's events took a whole core: requests waited seconds and the router's own health polls of
the engines timed out, so healthy engines were marked down (an outage caused by the router being late,
not the engine). Ingest therefore runs in short slices charged to one token bucket per process, refilled
at ``idle_share`` seconds of work per second while no request is in flight, and while requests are served at a
share that follows the loop's own lag (gateway/loop_lag.py), since every ready request waits about as long as the
loop runs late: each on-time reading raises it by ``raise_step`` up to ``idle_share``, each reading later than
``lag_target_s`` halves it, down to ``share``. Keying on "a request is in flight" alone capped ingest at 0.3 of the
loop under light continuous traffic, however idle the loop was (70k block ops/s on a replica that had most of a
core free); keying on the lag alone starved ingest on a machine with no core free, where the lag is the machine's
(6.5k of 10k block ops/s applied in a window without chat). Dropping to ``share`` for a second after any late
reading (the rule before this one) kept ingest at 0.3 under continuous chat, whose own requests make readings
late (its loop-lag p99 was 10-25 ms with no events published): a replica applied 44% of 150k block ops/s in a
minute of chat while it waited for a core 12% of the time and its chat p99 was 1.24x idle's.
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
    lag_target_s: float = 0.05
    """Loop lag above this means the loop is behind (a reading a whole watch interval late): the serving share is
    halved. Requests make lag on their own: continuous chat with no events published read 10-25 ms at p99. At
    5 ms those readings halved the share again and again, and at 150k block ops/s with chat a replica deferred
    ingest for 43 s of a 60-s burst, its index 2.5 s behind at p99; at 50 ms it deferred 2.4-3.2 s, its index
    under 0.1 s behind at p99 in one of six runs and 0.14-0.63 s in the others, with chat p99 1.29-1.73x idle's."""
    raise_step: float = 0.05
    """What each on-time lag reading adds to the serving share (readings come 20 a second: from ``share`` to
    ``idle_share`` in about 0.6 s)."""
    fresh_s: float = 0.25
    """Lag readings older than this do not vouch for headroom (nobody watching: the lower share)."""
    serving_share: float = field(init=False)
    """The share while requests are served, moved by the lag readings between ``share`` and ``idle_share``."""
    observed_at: float = -math.inf
    tokens: float = 0.003
    updated_at: float | None = None

    def __post_init__(self) -> None:
        if (not (0 < self.share <= self.idle_share <= 1) or self.burst_s <= 0 or self.slice_s <= 0
                or self.raise_step <= 0):
            raise ValueError("ingest budget: shares in (0, 1] (share <= idle_share), positive burst, slice and step")
        self.tokens = self.burst_s
        self.serving_share = self.share

    def observe_lag(self, now: float, lag_s: float) -> None:
        """The loop woke ``lag_s`` late at ``now`` (fed by the loop-lag watcher): late halves the serving share,
        on time raises it a step."""
        self.observed_at = now
        if lag_s > self.lag_target_s:
            self.serving_share = max(self.share, self.serving_share / 2)
        else:
            self.serving_share = min(self.idle_share, self.serving_share + self.raise_step)

    def share_now(self, now: float) -> float:
        """The share ingest may take: the idle share while no request is in flight, the serving share while
        fresh lag readings vouch for it, the lower share otherwise."""
        if not self.serving():
            return self.idle_share
        return self.serving_share if now - self.observed_at <= self.fresh_s else self.share

    def _rate(self, now: float) -> float:
        return self.share_now(now)

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
