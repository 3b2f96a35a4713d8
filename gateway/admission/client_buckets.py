"""A small token bucket per client, for endpoints that are cheap to call and costly to answer many times.

``/debug/route`` tokenizes and scores every engine; callers are few (operators), so each gets a modest
burst and a steady rate. The table is bounded: a client that rotates its address can only evict buckets,
and an evicted bucket comes back full, so the bound trades a little leniency for bounded memory.
"""

from __future__ import annotations

from gateway.admission.decision import ADMIT, Decision, Reject
from gateway.admission.token_bucket import TokenBucket


class ClientBuckets:
    def __init__(self, rate: float, burst: float, max_clients: int = 4096) -> None:
        self.rate, self.burst, self.max_clients = rate, burst, max_clients
        self._buckets: dict[str, TokenBucket] = {}

    def admit(self, client: str, now: float, what: str) -> Decision:
        """Take one token from ``client``'s bucket, or a 429 naming ``what`` with the wait until one is back."""
        bucket = self._buckets.pop(client, None) or TokenBucket.full(self.rate, self.burst, now)
        self._buckets[client] = bucket  # most recently used last: eviction drops the longest idle
        if len(self._buckets) > self.max_clients:
            del self._buckets[next(iter(self._buckets))]
        wait = bucket.wait_time(1.0, now)
        if wait is None or wait > 0:
            return Reject(wait, f"{what} allows {self.rate:g} calls per second per client")
        bucket.take(1.0, now)
        return ADMIT
