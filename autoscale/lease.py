"""Who runs the autoscaler in a mesh: one lease in the replicated document, sans-IO.

The lease is ``{holder, expires_at, term}`` (unix seconds: replicas' clocks are assumed in step to well
under the TTL). Its holder renews it; when it expires, or its holder is no longer a live member, the lowest
replica id that nobody suspects takes it with the next term. Concurrent claims converge in the document to
one holder, and a new holder waits ``settle_s`` before acting, so a claim that lost is seen first.

A replica that sees less than a majority of the replicas it saw during the last ``QUORUM_WINDOW_S`` neither
renews nor claims: a holder partitioned away into a minority lets its lease lapse and stops acting, while
the majority takes over (so partitions need three replicas or more to keep an actor).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field

QUORUM_WINDOW_S = 60.0


@dataclass(frozen=True)
class Lease:
    holder: str
    expires_at: float
    term: int

    def to_json(self) -> str:
        return json.dumps({"holder": self.holder, "expires_at": round(self.expires_at, 3), "term": self.term})

    @classmethod
    def from_json(cls, text: str | None) -> Lease | None:
        """None when absent or malformed (a malformed lease is treated as free)."""
        if text is None:
            return None
        try:
            data = json.loads(text)
            lease = cls(str(data["holder"]), float(data["expires_at"]), int(data["term"]))
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        return lease if lease.expires_at == lease.expires_at else None


@dataclass
class LeaseKeeper:
    """Decides, from the lease in the document and the membership, what this replica writes and may do."""

    me: str
    ttl_s: float = 3.0
    settle_s: float = 1.0
    _sizes: deque[tuple[float, int]] = field(default_factory=deque)
    _acquired: tuple[int, float] | None = None

    def quorum(self, now: float, alive: Set[str]) -> bool:
        self._sizes.append((now, len(alive)))
        while self._sizes and self._sizes[0][0] < now - QUORUM_WINDOW_S:
            self._sizes.popleft()
        known = max(size for _, size in self._sizes)
        return 2 * len(alive) > known

    def claim(self, current: Lease | None, now: float, live: Set[str], alive: Set[str]) -> Lease | None:
        """The lease to write now (a renewal or a claim), or None to leave the document as it is."""
        if not self.quorum(now, alive):
            return None
        if current is not None and current.holder == self.me and current.expires_at > now:
            if current.expires_at - now < self.ttl_s * 2 / 3:
                return Lease(self.me, now + self.ttl_s, current.term)
            return None
        if current is not None and current.expires_at > now and current.holder in live:
            return None
        candidates = set(alive) - ({current.holder} if current is not None else set())
        if not candidates or min(candidates) != self.me:
            return None
        return Lease(self.me, now + self.ttl_s, (current.term if current else 0) + 1)

    def acting(self, current: Lease | None, now: float, isolated: bool = False) -> bool:
        """True while this replica holds an unexpired lease it has held for ``settle_s``, with quorum."""
        if isolated or current is None or current.holder != self.me or current.expires_at <= now:
            self._acquired = None
            return False
        if self._acquired is None or self._acquired[0] != current.term:
            self._acquired = (current.term, now)
        has_quorum = bool(self._sizes) and 2 * self._sizes[-1][1] > max(s for _, s in self._sizes)
        return has_quorum and now - self._acquired[1] >= self.settle_s
