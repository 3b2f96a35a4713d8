"""Sans-IO freshness of one engine's cache knowledge and the confidence derived from it.

An idle engine publishes nothing, so silence only counts against an engine that its last /metrics
poll showed busy; silence is measured from when it became busy, not from its last event. Lost
batches (unfillable gaps) make the state partly unknown for a while; so does ingest that falls behind
the engine's stream (the router deferring event work to keep serving, events/ingest_budget.py): while
behind, knowledge decays like silence does. An index loaded from a peer's snapshot (a warm start) is
trusted less until this replica's own events confirm it, and the less the further the peer lagged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FreshnessPolicy:
    silence_grace_s: float = 2.0
    silence_half_life_s: float = 10.0
    poll_stale_s: float = 5.0
    loss_penalty: float = 0.5
    loss_recovery_s: float = 30.0


class EngineFreshness:
    """Counters and timestamps for one engine; `confidence(now)` is in [0, 1]."""

    def __init__(self, has_events: bool = True, policy: FreshnessPolicy | None = None) -> None:
        self.has_events = has_events
        self.policy = policy or FreshnessPolicy()
        self.last_event_at: float | None = None
        self.last_seq: int | None = None
        self.gaps = 0
        self.lost_batches = 0
        self.replay_failures = 0
        self.resets = 0
        self.last_loss_at: float | None = None
        self.last_poll_at: float | None = None
        self.running: int | None = None
        self.busy_since: float | None = None
        self.behind_since: float | None = None
        """When ingest last started deferring this engine's events (None: caught up)."""
        self.warm_lag_s: float | None = None
        """While the index holds a peer's snapshot no own event has confirmed yet: how far that peer lagged."""

    def on_events(self, now: float, seq: int) -> None:
        self.last_event_at = now
        self.last_seq = seq
        self.warm_lag_s = None

    def on_warm(self, lag_s: float) -> None:
        """The index was loaded from a peer's snapshot that lagged the engine's stream by ``lag_s``."""
        self.warm_lag_s = max(0.0, lag_s)

    def lag(self, now: float) -> float:
        """How far this replica's index of the engine is behind the engine's stream, as far as it knows:
        the time its ingest has been deferring, plus the lag of a peer snapshot not yet confirmed."""
        behind = now - self.behind_since if self.behind_since is not None else 0.0
        return behind + (self.warm_lag_s or 0.0)

    def on_gap(self) -> None:
        self.gaps += 1

    def on_lost(self, now: float, batches: int) -> None:
        self.lost_batches += batches
        self.last_loss_at = now

    def on_replay_failed(self) -> None:
        self.replay_failures += 1

    def on_reset(self) -> None:
        self.resets += 1

    def on_poll(self, now: float, running: int) -> None:
        if running > 0 and (self.running is None or self.running == 0):
            self.busy_since = now
        self.running = running
        self.last_poll_at = now

    def on_deferred(self, now: float) -> None:
        """Ingest had to wait with this engine's events queued: the index lags the engine."""
        if self.behind_since is None:
            self.behind_since = now

    def on_caught_up(self) -> None:
        """Every queued event of this engine has been applied."""
        self.behind_since = None

    def confidence(self, now: float) -> float:
        if self.has_events and self.last_event_at is None and self.last_poll_at is None:
            return 0.0
        p = self.policy
        value = 1.0
        if self.has_events:
            silence = self._suspicious_silence(now)
            if silence > p.silence_grace_s:
                value *= 0.5 ** ((silence - p.silence_grace_s) / p.silence_half_life_s)
        if self.last_loss_at is not None:
            remaining = max(0.0, 1.0 - (now - self.last_loss_at) / p.loss_recovery_s)
            value *= 1.0 - p.loss_penalty * remaining
        if self.behind_since is not None:
            value *= 0.5 ** (1 + max(0.0, now - self.behind_since) / p.silence_half_life_s)
        if self.warm_lag_s is not None:
            value *= 0.5 ** (1 + self.warm_lag_s / p.silence_half_life_s)
        return min(1.0, max(0.0, value))

    def _suspicious_silence(self, now: float) -> float:
        """Seconds of silence that cannot be explained by the engine being idle."""
        poll_fresh = self.last_poll_at is not None and now - self.last_poll_at <= self.policy.poll_stale_s
        if poll_fresh and self.running == 0:
            return 0.0
        since = self.last_event_at
        if poll_fresh and self.busy_since is not None:
            since = self.busy_since if since is None else max(since, self.busy_since)
        if since is None:
            since = self.last_poll_at if self.last_poll_at is not None else now
        return max(0.0, now - since)
