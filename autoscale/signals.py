"""Reading signals out of cumulative metrics: a quantile of what a histogram observed between two looks."""

from __future__ import annotations

import math
from collections.abc import Mapping


def histogram_quantile(q: float, before: Mapping[float, float], after: Mapping[float, float]) -> float | None:
    """Quantile ``q`` of the observations between two snapshots of cumulative buckets (upper bound ->
    count), interpolated inside the bucket as Prometheus does; None without observations."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = bound, count
    return lower
