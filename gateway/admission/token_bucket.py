"""A token bucket (sans-IO): over any interval of length T it admits at most ``rate * T + capacity``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    rate: float
    capacity: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate: float, capacity: float, now: float) -> TokenBucket:
        return cls(rate, capacity, capacity, now)

    def _refill(self, now: float) -> None:
        # A clock that steps back never refills; the bucket just waits for time to catch up.
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def wait_time(self, cost: float, now: float) -> float | None:
        """Seconds until ``cost`` fits (0 if it fits now); None if it never can (cost > capacity)."""
        if cost > self.capacity:
            return None
        self._refill(now)
        return max(0.0, (cost - self.tokens) / self.rate)

    def take(self, cost: float, now: float) -> None:
        self._refill(now)
        self.tokens -= cost
