"""Pure arithmetic over request results: percentiles, throughput and how load spread over engines."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """What one request did, in seconds since it was started; ``error`` is empty on success.

    ``started`` is the start time relative to the beginning of the run, for timelines. ``key`` and
    ``turn`` name the conversation turn that was sent. ``prompt_tokens`` and ``cached_tokens`` are the
    engine's own usage report; ``reusable_tokens`` is the request's shared prefix in whole blocks (see
    ``bench.prefix``), 0 when it has none worth judging.
    """

    started: float = 0.0
    status: int = 0
    ttft: float | None = None
    total: float = 0.0
    output_tokens: int = 0
    route: str = ""
    error: str = ""
    content: str = ""
    key: str = ""
    turn: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    reusable_tokens: int = 0
    retried: bool = False
    """Sent again to another router replica after the first one was killed under it."""

    @property
    def ok(self) -> bool:
        return not self.error and 200 <= self.status < 300

    @property
    def prefix_hit(self) -> bool | None:
        """Whether the engine served the whole shared prefix from its cache; None when not judged
        (failed request, no shared prefix of a full block, or no ``cached_tokens`` in the answer)."""
        if not self.ok or self.reusable_tokens <= 0 or self.cached_tokens is None:
            return None
        return self.cached_tokens >= self.reusable_tokens


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of unsorted values; NaN when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Summary:
    """One run of one workload: the numbers a table row shows."""

    requests: int
    errors: int
    wall: float
    ttft_p50: float
    ttft_p95: float
    latency_p50: float
    latency_p99: float
    req_per_s: float
    out_tok_per_s: float
    routes: dict[str, int] = field(default_factory=dict)
    error_kinds: dict[str, int] = field(default_factory=dict)
    prefix_hits: int = 0
    prefix_judged: int = 0

    @property
    def request_hit_rate(self) -> float:
        """Share of judged requests whose shared prefix the engine served from cache (a per-request
        rate, as published gateways report it); NaN when no request could be judged."""
        return self.prefix_hits / self.prefix_judged if self.prefix_judged else math.nan


def summarize(results: list[RequestResult], wall: float) -> Summary:
    """Latencies over successful requests only; throughput counts successes over the wall time."""
    good = [r for r in results if r.ok]
    ttfts = [r.ttft for r in good if r.ttft is not None]
    totals = [r.total for r in good]
    rate = len(good) / wall if wall > 0 else 0.0
    judged = [r.prefix_hit for r in good if r.prefix_hit is not None]
    return Summary(
        requests=len(results),
        errors=len(results) - len(good),
        wall=wall,
        ttft_p50=percentile(ttfts, 50),
        ttft_p95=percentile(ttfts, 95),
        latency_p50=percentile(totals, 50),
        latency_p99=percentile(totals, 99),
        req_per_s=rate,
        out_tok_per_s=sum(r.output_tokens for r in good) / wall if wall > 0 else 0.0,
        routes=dict(Counter(r.route for r in good if r.route)),
        error_kinds=dict(Counter((r.error or f"http {r.status}") for r in results if not r.ok)),
        prefix_hits=sum(judged),
        prefix_judged=len(judged),
    )


def shares(counts: dict[str, float], keys: list[str]) -> list[float]:
    """Each key's fraction of the total, in the order given (zeros when nothing was counted)."""
    total = sum(counts.get(k, 0.0) for k in keys)
    return [counts.get(k, 0.0) / total if total else 0.0 for k in keys]


def ratio(value: float, baseline: float) -> float:
    """value / baseline, NaN when the baseline is zero or missing."""
    if not baseline or math.isnan(baseline) or math.isnan(value):
        return math.nan
    return value / baseline


def late_hit_rate(results: list[RequestResult], skip: int) -> float:
    """Cached over prompt tokens, by the engines' usage reports, of the requests sent after the first ``skip``
    (in the order they were sent): the same later part of the trace for every entry of a shape, so a run in
    which a router replica was killed after ``skip`` requests compares with the runs in which none was. NaN
    when none of them reported usage."""
    later = sorted(results, key=lambda r: r.started)[skip:]
    reported = [r for r in later if r.ok and r.prompt_tokens and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    return sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else math.nan
