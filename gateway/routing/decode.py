"""What a request's own decoding will cost on each engine: output tokens x time per token at that batch size.

Time to first token alone is the wrong objective under load. On an engine that admits new requests into
its running batch at once, piling requests onto the engine that holds a hot prefix barely delays their
first token, but every request in that batch then decodes more slowly. Closed-loop clients see that as
throughput collapse: a published cache-aware router fell to 0.44x of round robin exactly this way. So
the cost model adds the decode time the request itself will see, learned per engine as
``time per token = base + per_request * requests in the batch``, and ranks by time to the last token.
At low concurrency every engine's batch is empty, this term is equal everywhere, and cache reuse decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gateway.routing.pooling import between_engine_variance

_MAX_TPOT_S = 10.0
_MAX_TOKENS = 1_000_000


@dataclass(frozen=True, slots=True)
class DecodePrior:
    """Before-data beliefs (A40-class engine, ~1.5B model) and how fast observations replace them.

    ``weight``: what the fixed prior is worth in observations; the fleet's fit is worth between
    ``engine_weight`` and ``max_engine_weight`` observations as the prior of one engine, by how far the
    engines' own lines scatter beyond their noise (``DecodeModel.engine_weight``). An engine is judged by the
    fleet's speed until its own streams say otherwise: an engine that has served nothing yet (new, or
    restarted) must not look slower than its twins because only they have data, or it would never get the
    traffic that teaches otherwise; nor may twins look different because of their noise (ten identical
    engines were learned 317-420 ms apart for one answer on a loaded machine, which sent every new prefix to
    the engines that had served).
    """

    base_s: float = 0.010
    per_request_s: float = 0.0005
    output_tokens: float = 128.0
    weight: float = 1.0
    engine_weight: float = 4.0
    max_engine_weight: float = 4096.0
    min_noise_s: float = 1e-4
    """The smallest noise of a time per token assumed when judging engines apart (streams that all agree)."""
    decay: float = 0.98
    output_decay: float = 0.95
    fleet_refit_share: float = 1 / 16
    """The fleet's line and how much it weighs are redone once the observations since reach this share of the
    (decayed) observations they came from; an engine's own line takes each of its observations at once
    (as ``TTFTPrior.fleet_refit_share``)."""


PSEUDO_DEPTH = 8.0


def _pulls(weight: float) -> tuple[float, float]:
    """A prior worth ``weight`` observations, on the base (as ``weight`` / 2 at depth 0) and on the slope (as
    ``weight`` spread half at depth 0, half at ``PSEUDO_DEPTH``), each alone: its variances are 2 / weight and
    4 / (weight D^2) noise variances."""
    return weight / 2, weight * PSEUDO_DEPTH ** 2 / 4


@dataclass(slots=True)
class _Stats:
    """Exponentially weighted sums for a least-squares line of time per token against batch depth."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.n, self.sx, self.sy = self.n * decay + 1, self.sx * decay + x, self.sy * decay + y
        self.sxx, self.sxy, self.syy = self.sxx * decay + x * x, self.sxy * decay + x * y, self.syy * decay + y * y

    def plus(self, other: _Stats) -> _Stats:
        return _Stats(self.n + other.n, self.sx + other.sx, self.sy + other.sy, self.sxx + other.sxx,
                      self.sxy + other.sxy, self.syy + other.syy)

    def squared_residuals(self, base: float, slope: float) -> float:
        """Sum of squared distances of the data from a line."""
        fitted = base * base * self.n + 2 * base * slope * self.sx + slope * slope * self.sxx
        return max(0.0, self.syy - 2 * (base * self.sy + slope * self.sxy) + fitted)

    def _normal(self, weight: float) -> tuple[float, float, float]:
        """The least-squares normal matrix [[a, b], [b, c]] of these data with the prior's pulls (``_pulls``)."""
        pull_base, pull_slope = _pulls(weight)
        return self.n + pull_base, self.sx, self.sxx + pull_slope

    def line_around(self, base: float, slope: float, weight: float) -> tuple[float, float]:
        """(base, slope) of these data pulled toward a prior line, its base and its slope each on its own.

        The prior used to be pseudo-data on the prior line itself (half at depth 0, half at ``PSEUDO_DEPTH``),
        which ties its slope to its base: streams that all decode alone (depth 0, the usual case at low load,
        and what a router that avoids busy engines sees) move the base to the engine's real speed while the
        pseudo-point at depth 8 stays at the prior's absolute time, so the slope became (prior time at depth 8 -
        real base) / 8. On a simulated A40 at a quarter of its clock that was ~1.4 ms per token per stream where
        the engine's is ~0.05, and a multi-turn chat with 411-token answers left its history for the idle engine
        at most turns (seed 2 suite shape #13, 2 engines: 0.60-0.67 of the bound, smg 0.79-0.81)."""
        a, b, c = self._normal(weight)
        pull_base, pull_slope = _pulls(weight)
        rhs_base, rhs_slope = self.sy + pull_base * base, self.sxy + pull_slope * slope
        det = a * c - b * b
        fitted_slope = max(0.0, (a * rhs_slope - b * rhs_base) / det) if det > 1e-12 else max(0.0, slope)
        return max(0.0, (rhs_base - b * fitted_slope) / a), fitted_slope

    def variances_around(self, weight: float) -> tuple[float, float]:
        """Sampling variances of ``line_around``'s base and slope, per unit of noise variance."""
        a, b, c = self._normal(weight)
        det = a * c - b * b
        return (c / det, a / det) if det > 1e-12 else (math.inf, math.inf)


@dataclass
class DecodeModel:
    prior: DecodePrior = field(default_factory=DecodePrior)
    _stats: dict[str, _Stats] = field(default_factory=dict)
    _lines: dict[str, tuple[float, float]] = field(default_factory=dict)
    _fleet: tuple[float, float] | None = None
    _engine_weight: float | None = None
    _output_tokens: float | None = None
    _since_fleet_fit: int = 0
    _fleet_fit_weight: float = 0.0
    _doubt: float | None = None
    rejected: int = 0

    def _line(self, engine_id: str) -> tuple[float, float]:
        line = self._lines.get(engine_id)
        if line is None:
            own = self._stats.get(engine_id, _Stats())
            line = self._lines[engine_id] = own.line_around(*self._fleet_line(), self.engine_weight())
        return line

    def _fleet_line(self) -> tuple[float, float]:
        """(base, slope) of every engine's streams together, pulled toward the prior (fitted once per refit)."""
        if self._fleet is None:
            p = self.prior
            fleet = self._fleet_stats()
            self._fleet = fleet.line_around(p.base_s, p.per_request_s, p.weight)
            self._fleet_fit_weight = fleet.n
        return self._fleet

    def _fleet_stats(self) -> _Stats:
        fleet = _Stats()
        for stats in self._stats.values():
            fleet = fleet.plus(stats)
        return fleet

    def engine_weight(self) -> float:
        """What the fleet's line is worth as one engine's prior, in observations: ``max_engine_weight`` while the
        engines' own lines (each against the fixed prior) scatter only as their noise explains, down to
        ``engine_weight`` as a real difference shows (gateway/routing/pooling.py), and while fewer than two
        engines have streams (the fleet's line is then mostly the one engine's own). The prior's pulls
        (``_Stats.line_around``) give a line's base a variance of 2/w and its slope 4/(w D^2)
        noise variances: the weight is the one that matches the larger real spread."""
        if self._engine_weight is None:
            self._engine_weight = self._pooled_weight()
        return self._engine_weight

    def _pooled_weight(self) -> float:
        p = self.prior
        own = [s for s in self._stats.values() if s.n > 3]
        if len(own) < 2:
            return p.engine_weight
        lines = [s.line_around(p.base_s, p.per_request_s, p.weight) for s in own]
        residual = sum(s.squared_residuals(*line) for s, line in zip(own, lines, strict=True))
        noise = max(residual / sum(s.n - 2 for s in own), p.min_noise_s ** 2)
        variances = [s.variances_around(p.weight) for s in own]
        spread = between_engine_variance(np.array(lines), noise * np.array(variances))
        per_unit = (2.0, 4.0 / PSEUDO_DEPTH ** 2)
        weights = [u * noise / t for u, t in zip(per_unit, spread.tolist(), strict=True) if t > 0]
        return min(p.max_engine_weight, max(p.engine_weight, min(weights, default=p.max_engine_weight)))

    def slope_doubt(self) -> float:
        """One standard error of the fleet's slope (time per token per stream in the batch), relative to the slope,
        at most 1: how much of a decode gap between two engines at different depths is forecast, not measured.

        A handful of streams decides the slope before traffic has taught it: on an agentic suite shape (seed 1
        #2, 375-token answers) nine streams in six seconds (six 5-token answers at depth 0, three long ones at
        depths 1-2, 3.0 against 3.8 ms a token) made one stream deeper worth 79 ms of decode, where the engine's
        own step adds 0.04 ms a token per stream; and a session holding 88% of its 7.5k-token prompt left for an
        idle engine, to a first token of 103-145 ms against 44-50 ms at home, finishing no sooner."""
        if self._doubt is None:
            p = self.prior
            fleet = self._fleet_stats()
            base, slope = self._fleet_line()
            noise = max(fleet.squared_residuals(base, slope) / max(fleet.n - 2, 1.0), p.min_noise_s ** 2)
            error = math.sqrt(noise * fleet.variances_around(p.weight)[1])
            self._doubt = min(1.0, error / slope) if slope > 0 else 0.0
        return self._doubt

    def time_per_token_s(self, engine_id: str, batch_depth: float) -> float:
        base, slope = self._line(engine_id)
        return base + slope * max(0, batch_depth)

    def expected_output_tokens(self, max_tokens: int | None) -> float:
        """The request's cap when given, else the recent average answer length (or the prior's)."""
        typical = self._output_tokens if self._output_tokens is not None else self.prior.output_tokens
        return float(min(max_tokens, typical)) if max_tokens is not None else typical

    def tokens_after_first(self, max_tokens: int | None) -> float:
        """The tokens a request decodes after its first (``expected_output_tokens`` less one)."""
        return max(0.0, self.expected_output_tokens(max_tokens) - 1)

    def decode_s(self, engine_id: str, batch_depth: int, max_tokens: int | None) -> float:
        """Time from the first token to the last for a request joining a batch of ``batch_depth``."""
        return self.tokens_after_first(max_tokens) * self.time_per_token_s(engine_id, batch_depth)

    def observe(self, engine_id: str, batch_depth: int, output_tokens: int, decode_s: float) -> bool:
        """One finished stream: ``output_tokens`` events in ``decode_s`` after the first. Impossible values
        are counted and dropped."""
        valid = (isinstance(batch_depth, int) and batch_depth >= 0 and isinstance(output_tokens, int)
                 and 1 <= output_tokens <= _MAX_TOKENS and isinstance(decode_s, int | float)
                 and 0.0 <= decode_s <= _MAX_TPOT_S * output_tokens)
        if not valid:
            self.rejected += 1
            return False
        p = self.prior
        self._output_tokens = (output_tokens if self._output_tokens is None
                               else p.output_decay * self._output_tokens + (1 - p.output_decay) * output_tokens)
        if output_tokens >= 2:
            self._stats.setdefault(engine_id, _Stats()).add(float(batch_depth), decode_s / (output_tokens - 1),
                                                            p.decay)
            self._lines.pop(engine_id, None)
            self._since_fleet_fit += 1
            if self._since_fleet_fit >= p.fleet_refit_share * self._fleet_fit_weight:
                self._invalidate()
        return True

    def forget(self, engine_id: str) -> None:
        self._stats.pop(engine_id, None)
        self._invalidate()

    def _invalidate(self) -> None:
        """Every line leans on the fleet's: all are recomputed on next use."""
        self._lines.clear()
        self._fleet = None
        self._engine_weight = None
        self._doubt = None
        self._since_fleet_fit = 0
