"""Who runs the autoscaler in a mesh: one lease in the replicated document, sans-IO.

The lease is ``{holder, expires_at, term}`` (unix seconds: replicas' clocks are assumed in step to well
under ``ACT_MARGIN`` of the TTL). Its holder renews it; once it has expired, the lowest replica id that
nobody suspects takes it with the next term. A lease is never taken before it expires, even from a holder
that looks dead: a holder cut off by a partition looks dead too, and still acts until its lease runs out.
Its holder acts only while more than ``ACT_MARGIN`` of the TTL is left, so a holder whose loop stalled
past that stops before anyone else may start; the term goes with every provider call as a fencing token
for the calls already under way. Concurrent claims converge in the document to one holder, and a new
holder waits ``settle_s`` before acting, so a claim that lost is seen first.

Quorum (more than half of the membership alive) is needed to renew, claim or act, so a holder partitioned
into a minority lets its lease lapse and stops, while the majority takes over (partitions need three
replicas or more to keep an actor). The membership is the configured mesh size (``replicas``) or else the
member list the holder keeps in the document: a member joins it once seen alive by a holder (one per
change, so an old and a new majority always overlap), and leaves it once it left gracefully or has been
unseen for ``forget_s``. A minority never rewrites that list (it never holds the lease), so its quorum is
counted against the whole mesh however long the partition lasts, where a sliding window of "replicas seen
lately" would shrink to the minority itself within a minute. A replica whose document holds no member list
(a new mesh) waits ``join_s`` after its start before it claims, so a replica that starts alone does not
claim at once; one that starts cut off from a mesh that already keeps a list loads the list with the Redis
snapshot, or else only a configured ``replicas`` stops it.
"""

from __future__ import annotations

import json
from collections.abc import Set
from dataclasses import dataclass, field

ACT_MARGIN = 1 / 3
"""Share of the TTL left at which the holder stops acting; it renews when 2/3 are left, every TTL/6."""


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
        except (ValueError, TypeError, KeyError, RecursionError, OverflowError):
            return None
        return lease if lease.expires_at == lease.expires_at and lease.term >= 0 else None


def parse_members(text: str | None) -> frozenset[str]:
    """The member list as the holder wrote it (a JSON list of ids); empty when absent or malformed."""
    if text is None:
        return frozenset()
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return frozenset()
    if not isinstance(data, list) or not all(isinstance(m, str) for m in data):
        return frozenset()
    return frozenset(data)


@dataclass
class LeaseKeeper:
    """Decides, from the lease and member list in the document and the membership, what this replica writes
    and whether it may act. ``started_at`` is when this replica started (same clock as ``now``)."""

    me: str
    ttl_s: float = 3.0
    settle_s: float = 1.0
    replicas: int = 0
    join_s: float = 10.0
    forget_s: float = 60.0
    started_at: float = 0.0
    _acquired: tuple[int, float] | None = None
    _last_seen: dict[str, float] = field(default_factory=dict)

    def quorum(self, now: float, alive: Set[str], members: Set[str]) -> bool:
        """More than half of the membership is alive (see the module docstring)."""
        if self.replicas > 0:
            return 2 * len(alive) > self.replicas
        if members:
            return 2 * len(alive & members) > len(members)
        return now - self.started_at >= self.join_s

    def claim(self, current: Lease | None, now: float, alive: Set[str], members: Set[str]) -> Lease | None:
        """The lease to write now (a renewal or a claim), or None to leave the document as it is."""
        if not self.quorum(now, alive, members):
            return None
        if current is not None and current.holder == self.me and current.expires_at > now:
            if current.expires_at - now < self.ttl_s * 2 / 3:
                return Lease(self.me, now + self.ttl_s, current.term)
            return None
        if current is not None and current.expires_at > now:
            return None
        if min(alive) != self.me:
            return None
        return Lease(self.me, now + self.ttl_s, (current.term if current else 0) + 1)

    def acting(self, current: Lease | None, now: float, alive: Set[str], members: Set[str],
               isolated: bool = False) -> bool:
        """True while this replica holds a lease with more than ``ACT_MARGIN`` of its TTL left, has held
        it for ``settle_s``, and has quorum."""
        if (isolated or current is None or current.holder != self.me
                or current.expires_at - now <= self.ttl_s * ACT_MARGIN):
            self._acquired = None
            return False
        if self._acquired is None or self._acquired[0] != current.term:
            self._acquired = (current.term, now)
        return self.quorum(now, alive, members) and now - self._acquired[1] >= self.settle_s

    def members_update(self, now: float, alive: Set[str], members: Set[str], departed: Set[str]) -> list[str] | None:
        """While acting: the member list to write (one member more or fewer than now), or None to keep it.
        ``departed`` are members known to have left gracefully."""
        for member in alive:
            self._last_seen[member] = now
        if self.replicas > 0:
            return None
        if not members:
            return sorted(alive)
        joining = sorted(alive - members)
        if joining:
            return sorted(members | {joining[0]})
        gone = sorted(m for m in members - alive
                      if m in departed or now - self._last_seen.setdefault(m, now) > self.forget_s)
        if gone:
            return sorted(members - {gone[0]})
        return None
