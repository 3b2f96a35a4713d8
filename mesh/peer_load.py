"""Other replicas' in-flight requests per engine (sans-IO), shared every ~100 ms between replicas.

A replica's own in-flight count is fresh, but the engines' /metrics poll that shows everybody else's load
is up to a poll interval old. Replicas behind an L4 balancer that each send a burst to the engine that
looked idle at the last poll overload it together (``kvmesh bench targets``, workload d: a p95 TTFT of
1.8 s with two replicas against 0.19 s with one). Each replica therefore tells its peers how many
requests it has in flight per engine; the router adds the fresh sum to its own count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgpack

MAX_AGE_S = 2.0
"""A report older than this is ignored: its sender stopped reporting (gone, partitioned or idle)."""
MAX_ENGINES = 4096
MAX_COUNT = 1_000_000


def encode(loads: dict[str, int]) -> bytes:
    return msgpack.packb(loads)


def decode(payload: bytes) -> dict[str, int]:
    """The per-engine counts of one report; ValueError when it is not a bounded map of engine -> count."""
    try:
        loads = msgpack.unpackb(payload)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ValueError(f"undecodable load report: {exc}") from None
    if not isinstance(loads, dict) or len(loads) > MAX_ENGINES:
        raise ValueError("a load report is a map of at most 4096 engines")
    for engine, count in loads.items():
        if not isinstance(engine, str) or isinstance(count, bool) or not isinstance(count, int):
            raise ValueError("a load report maps engine ids to integer counts")
        if not 0 <= count <= MAX_COUNT:
            raise ValueError(f"in-flight count out of range: {count}")
    return loads


class PeerLoad:
    """The latest report of each peer, with the time it arrived.

    Every routing decision asks for the totals while reports arrive about ten times a second per peer, so
    the sum is kept until a report arrives, the oldest one expires or the live peers change.
    """

    def __init__(self, max_age_s: float = MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._reports: dict[str, tuple[dict[str, int], float]] = {}
        self._summed: tuple[tuple[str, ...] | None, float, dict[str, int]] | None = None

    def update(self, sender: str, payload: bytes, now: float) -> None:
        """Replace ``sender``'s report; a malformed one raises ValueError and leaves the old one in place."""
        self._reports[sender] = (decode(payload), now)
        self._summed = None

    def totals(self, now: float, live: Iterable[str] | None = None) -> dict[str, int]:
        """Per engine, the summed in-flight counts of fresh reports (of ``live`` senders, if given); the
        caller must not change the returned map."""
        key = None if live is None else tuple(live)
        if self._summed is not None and self._summed[0] == key and now <= self._summed[1]:
            return self._summed[2]
        allowed = None if key is None else set(key)
        out: dict[str, int] = {}
        valid_until = math.inf
        for sender, (loads, at) in list(self._reports.items()):
            if now - at > self.max_age_s:
                del self._reports[sender]
                continue
            if allowed is not None and sender not in allowed:
                continue
            valid_until = min(valid_until, at + self.max_age_s)
            for engine, count in loads.items():
                out[engine] = out.get(engine, 0) + count
        self._summed = (key, valid_until, out)
        return out
