"""Other replicas' in-flight requests per engine (sans-IO), shared every ~100 ms between replicas.

A replica's own in-flight count is fresh, but the engines' /metrics poll that shows everybody else's load
is up to a poll interval old. Replicas behind an L4 balancer that each send a burst to the engine that
looked idle at the last poll overload it together (measured: a p95 TTFT of 1.7 s instead of 0.19 s on
workload d with two replicas). Each replica therefore tells its peers how many requests it has in flight
per engine; the router adds the fresh sum to its own count.
"""

from __future__ import annotations

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
    """The latest report of each peer, with the time it arrived."""

    def __init__(self, max_age_s: float = MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._reports: dict[str, tuple[dict[str, int], float]] = {}

    def update(self, sender: str, payload: bytes, now: float) -> None:
        """Replace ``sender``'s report; a malformed one raises ValueError and leaves the old one in place."""
        self._reports[sender] = (decode(payload), now)

    def totals(self, now: float, live: Iterable[str] | None = None) -> dict[str, int]:
        """Per engine, the summed in-flight counts of fresh reports (of ``live`` senders, if given)."""
        allowed = None if live is None else set(live)
        out: dict[str, int] = {}
        for sender, (loads, at) in list(self._reports.items()):
            if now - at > self.max_age_s:
                del self._reports[sender]
                continue
            if allowed is not None and sender not in allowed:
                continue
            for engine, count in loads.items():
                out[engine] = out.get(engine, 0) + count
        return out
