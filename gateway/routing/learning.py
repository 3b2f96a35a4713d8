"""Per-engine TTFT model learned online: ttft = overhead + b*uncached + c*ahead_in_batch + d*ahead_of_slot.

A request waits behind the requests already on the engine: while free slots remain (``max_num_seqs``)
each one ahead only shares the batch with it (``c``); beyond the slots it must wait for a slot to free,
about one service time per ``max_num_seqs`` requests (``d``). Its own prefill costs ``b`` per uncached
token. The coefficients are fitted by exponentially weighted ridge regression pulled toward priors, so
directions the data never exercise (depth at c=1, say) keep their priors instead of drifting, old data
fade as engines change, and residuals beyond a few robust deviations lose weight quadratically, so a
stalled request barely moves the fit.

Engines of one fleet share most of their behaviour, so each engine's fit is pulled toward the fit of
the other engines' data (partial pooling) rather than toward the fixed priors: an engine's own difference
from the fleet counts only once its own observations back it, and only as far as the engines' fits scatter
beyond their noise (gateway/routing/pooling.py). Without this, a router replica that sees a fraction of
the traffic (one of N behind a balancer) learns each engine from a handful of TTFTs, and the noise of one
slow response makes one engine look milliseconds "faster" than its twins, which outweighs the cache of a
short multi-turn history and sends the turn elsewhere, or sends every new prefix to the engines that
happened to look fast.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from gateway.routing.pooling import between_engine_variance

_TOKEN_UNIT = 1000.0
_MAX_TOKENS = 10_000_000
_MAX_DEPTH = 1_000_000
_MAX_TTFT_S = 3600.0


@dataclass(frozen=True, slots=True)
class TTFTPrior:
    """Before-data beliefs, sized for an A40-class GPU serving a ~1.5B model, plus the learner's settings.

    ``weight``: how many observations the fixed priors are worth; the fleet's fit is worth between
    ``engine_weight`` (engines that really differ) and ``max_engine_weight`` (twins: their differences are
    within their noise) observations as the prior of one engine.
    """

    overhead_s: float = 0.015
    prefill_s_per_token: float = 1 / 20_000
    batch_s_per_request: float = 0.004
    service_s: float = 2.0
    weight: float = 1.0
    engine_weight: float = 8.0
    max_engine_weight: float = 4096.0
    decay: float = 0.995
    huber_k: float = 3.0
    scale_rate: float = 0.1
    min_scale_s: float = 0.001
    fleet_refit_share: float = 1 / 16
    """The fleet's terms (every engine's pooled prior, the spread between engines) are redone once the observations
    since their fit reach this share of the (decayed) observations they were fitted on; an engine's own data always
    count at once. One answer barely moves a fit made from hundreds, and redoing the fleet's fit after every
    answer took a third of a decision at 15 engines and grew with the fleet (py-spy of ``kvmesh bench decide``)."""


@dataclass(frozen=True, slots=True)
class TTFTParams:
    overhead_s: float
    prefill_s_per_token: float
    batch_s_per_request: float
    slot_wait_s_per_request: float

    def predict(self, uncached_tokens: float, queue_depth: int, max_num_seqs: int | None) -> float:
        return self.overhead_s + self.prefill_s(uncached_tokens) + self.queue_s(queue_depth, max_num_seqs)

    def prefill_s(self, uncached_tokens: float) -> float:
        return self.prefill_s_per_token * uncached_tokens

    def queue_s(self, queue_depth: int, max_num_seqs: int | None) -> float:
        in_batch, over = split_depth(queue_depth, max_num_seqs)
        return self.batch_s_per_request * in_batch + self.slot_wait_s_per_request * over


def split_depth(queue_depth: int, max_num_seqs: int | None) -> tuple[int, int]:
    """Requests ahead that share the batch, and how many slot releases must happen before ours starts (comparisons,
    not ``min``/``max`` calls: a decision asks this of every engine, see ``gateway.routing.cost._count``)."""
    depth = queue_depth if queue_depth > 0 else 0
    if max_num_seqs is None or max_num_seqs <= 0:
        return depth, 0
    over = depth - max_num_seqs + 1
    return (max_num_seqs if max_num_seqs < depth else depth), (over if over > 0 else 0)


_FEATURE_SCALES = (1.0, 1.0, 4.0, 1.0)
"""Typical sizes of the features (1, 1k tokens, 4 requests in the batch, 1 slot release)."""


def _coefficients(params: TTFTParams) -> list[float]:
    return [params.overhead_s, params.prefill_s_per_token * _TOKEN_UNIT, params.batch_s_per_request,
            params.slot_wait_s_per_request]


def _precision(weight: float) -> list[float]:
    """A prior worth ``weight`` observations at a typical size of each feature."""
    return [weight * s * s for s in _FEATURE_SCALES]


@dataclass
class EngineTTFTModel:
    """Sufficient statistics for one engine and its last fit (made by ``TTFTLearner``, which pools engines)."""

    prior: TTFTPrior
    max_num_seqs: int | None = None
    observations: int = 0
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 4)
    _yty: float = 0.0
    _relative_scale: float = 0.25
    _params: TTFTParams | None = None

    def _features(self, uncached_tokens: float, queue_depth: int) -> list[float]:
        in_batch, over = split_depth(queue_depth, self.max_num_seqs)
        return [1.0, uncached_tokens / _TOKEN_UNIT, float(in_batch), float(over)]

    def prior_params(self) -> TTFTParams:
        """The fixed priors, with the slot wait of this engine's ``max_num_seqs``."""
        p = self.prior
        slot_wait = p.service_s / self.max_num_seqs if self.max_num_seqs else 0.0
        return TTFTParams(p.overhead_s, p.prefill_s_per_token, p.batch_s_per_request, slot_wait)

    @property
    def params(self) -> TTFTParams:
        """The last fit (see ``refit``); the fixed priors before the first one."""
        if self._params is None:
            self._params = self.prior_params()
        return self._params

    def set_slots(self, max_num_seqs: int | None) -> None:
        if max_num_seqs != self.max_num_seqs:
            self.max_num_seqs = max_num_seqs
            self._params = None

    @property
    def deviation(self) -> float:
        """One robust standard deviation of this engine's TTFT predictions, relative to the prediction."""
        return 1.4826 * self._relative_scale

    def _robust_weight(self, residual: float, predicted: float) -> float:
        """Full weight within ``huber_k`` robust deviations, fading quadratically beyond.

        TTFT noise grows with TTFT, so the deviation is relative: a running median of |residual| / prediction
        (multiplicative steps up or down), which a burst of outliers moves only slowly, yet which follows a
        real change of the engine within a few dozen requests.
        """
        p = self.prior
        median = self._relative_scale
        limit = max(p.min_scale_s, p.huber_k * self.deviation * max(predicted, 0.0))
        relative = abs(residual) / max(predicted, p.min_scale_s)
        step = 1.0 + p.scale_rate
        self._relative_scale = median * step if relative > median else median / step
        return 1.0 if abs(residual) <= limit else (limit / residual) ** 2

    def observe(self, uncached_tokens: float, queue_depth: int, ttft_s: float) -> None:
        x = self._features(uncached_tokens, queue_depth)
        predicted = self.params.predict(uncached_tokens, queue_depth, self.max_num_seqs)
        residual = ttft_s - predicted
        weight = self._robust_weight(residual, predicted)
        keep = self.prior.decay
        self._yty = keep * self._yty + weight * ttft_s * ttft_s
        for i in range(4):
            self._xty[i] = keep * self._xty[i] + weight * x[i] * ttft_s
            row = self._xtx[i]
            for j in range(4):
                row[j] = keep * row[j] + weight * x[i] * x[j]
        self.observations += 1


class TTFTLearner:
    """All engines' TTFT models, each fitted around the fleet's fit of the other engines' data.

    An engine's center is the fixed priors updated with every other engine's statistics (leave-one-out,
    so its own data is not counted twice); its own statistics then move it away from that center as far
    as they are worth against ``engine_weight``. Fits are redone lazily: an engine's own after each of its
    observations, the fleet's terms once enough new observations arrived (``TTFTPrior.fleet_refit_share``).

    Feedback outside physical bounds (negative, NaN, more than 10M tokens, 1M queued, an hour to first
    token) is counted in ``rejected`` and dropped: one corrupt measurement must not poison the fit.
    """

    def __init__(self, prior: TTFTPrior | None = None) -> None:
        self.prior = prior or TTFTPrior()
        self._models: dict[str, EngineTTFTModel] = {}
        self._stale = True
        """The fleet's terms must be redone before the next fit."""
        self._pulls: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        """Per engine, from the last fleet fit: the precision of its pooled prior and that times the prior's mean."""
        self._dirty: set[str] = set()
        """Engines with observations since their own fit."""
        self._since_fleet_fit = 0
        self._fleet_fit_weight = 0.0
        self.rejected = 0

    def model(self, engine_id: str) -> EngineTTFTModel:
        found = self._models.get(engine_id)
        if found is None:
            found = self._models[engine_id] = EngineTTFTModel(self.prior)
            self._stale = True
        return found

    def prepare(self, slots_by_engine: Iterable[tuple[str, int | None]]) -> None:
        """Models for a decision's engines with their slots, none fitted yet (see ``CostModel.prepare``)."""
        for engine_id, max_num_seqs in slots_by_engine:
            self._slotted(engine_id, max_num_seqs)

    def _slotted(self, engine_id: str, max_num_seqs: int | None) -> EngineTTFTModel:
        model = self.model(engine_id)
        if max_num_seqs != model.max_num_seqs:
            model.set_slots(max_num_seqs)
            self._stale = True
        return model

    def params(self, engine_id: str, max_num_seqs: int | None) -> TTFTParams:
        model = self._models.get(engine_id)
        if (model is not None and model._params is not None and not self._stale and model.max_num_seqs == max_num_seqs
                and engine_id not in self._dirty):  # the fit is current: a decision asks this of every engine twice
            return model._params
        model = self._slotted(engine_id, max_num_seqs)
        self._refresh(engine_id, model)
        return model.params

    def _refresh(self, engine_id: str, model: EngineTTFTModel) -> None:
        """Make ``model.params`` current: the whole fleet when its terms are due, else this engine's own fit."""
        if self._stale:
            self._refit()
        elif engine_id in self._dirty:
            self._dirty.discard(engine_id)
            precision, pull = self._pulls[engine_id]
            fitted = np.linalg.solve(np.array(model._xtx) + precision, np.array(model._xty) + pull)
            model._params = _fitted_params(*fitted.tolist())

    def _refit(self) -> None:
        """Per engine: the fleet's mean (priors plus the other engines' data) and how sure it is, widened by
        how far one engine may differ from its fleet, is the prior its own data update (Gaussian pooling).

        All engines are solved at once with numpy: the fit is redone after every observation, and done one
        engine at a time in Python it cost 13.5 ms per request in front of 100 engines (``kvmesh bench decide``).
        """
        models = list(self._models.values())
        if not models:
            self._stale = False
            return
        xtx = np.array([m._xtx for m in models])
        xty = np.array([m._xty for m in models])
        prior_mean = np.array([_coefficients(m.prior_params()) for m in models])
        fleet_precision = np.array(_precision(self.prior.weight))
        yty = np.array([m._yty for m in models])
        spread = np.diag(self._spread(xtx, xty, yty, prior_mean, fleet_precision))
        others = xtx.sum(axis=0) - xtx + np.diag(fleet_precision)
        rhs = xty.sum(axis=0) - xty + fleet_precision * prior_mean
        center = np.linalg.solve(others, rhs[..., None])
        precision = np.linalg.inv(np.linalg.inv(others) + spread)
        pull = (precision @ center)[..., 0]
        fitted = np.linalg.solve(xtx + precision, (xty + pull)[..., None])[..., 0]
        self._pulls = {}
        for engine_id, model, row, own_precision, own_pull in zip(self._models, models, fitted.tolist(), precision,
                                                                   pull, strict=True):
            model._params = _fitted_params(*row)
            self._pulls[engine_id] = (own_precision, own_pull)
        self._stale = False
        self._dirty.clear()
        self._since_fleet_fit = 0
        self._fleet_fit_weight = float(xtx[:, 0, 0].sum())

    def _spread(self, xtx: np.ndarray, xty: np.ndarray, yty: np.ndarray, prior_mean: np.ndarray,
                fixed_precision: np.ndarray) -> np.ndarray:
        """Per coefficient, how far one engine's true value may sit from its fleet's, in units of the TTFT noise
        variance that the sums are in: the between-engine variance of the engines' own fits (against the fixed
        priors only; gateway/routing/pooling.py) over the pooled residual variance, kept between what
        ``max_engine_weight`` and ``engine_weight`` observations at a typical size of each feature allow. Fewer
        than two engines with data beyond their four coefficients show no difference: the narrowest spread."""
        p = self.prior
        widest = 1.0 / np.array(_precision(p.engine_weight))
        narrowest = 1.0 / np.array(_precision(p.max_engine_weight))
        counts = xtx[:, 0, 0]
        own = counts > len(_FEATURE_SCALES) + 1
        if own.sum() < 2:
            return narrowest
        a = xtx[own] + np.diag(fixed_precision)
        estimates = np.linalg.solve(a, (xty[own] + fixed_precision * prior_mean[own])[..., None])[..., 0]
        fitted_xty = np.einsum("ek,ek->e", estimates, xty[own])
        fitted_xtx = np.einsum("ej,ejk,ek->e", estimates, xtx[own], estimates)
        residual = np.maximum(0.0, yty[own] - 2 * fitted_xty + fitted_xtx).sum()
        noise = max(residual / (counts[own] - len(_FEATURE_SCALES)).sum(), p.min_scale_s ** 2)
        variances = noise * np.diagonal(np.linalg.inv(a), axis1=1, axis2=2)
        return np.clip(between_engine_variance(estimates, variances) / noise, narrowest, widest)

    def deviation(self, engine_id: str) -> float:
        """How far an engine's measured TTFTs stray from the fit, relative to it (``EngineTTFTModel.deviation``)."""
        return self.model(engine_id).deviation

    def observe(self, engine_id: str, uncached_tokens: float, queue_depth: int, ttft_s: float) -> bool:
        valid = (
            isinstance(engine_id, str)
            and _within(uncached_tokens, _MAX_TOKENS)
            and _within(queue_depth, _MAX_DEPTH)
            and _within(ttft_s, _MAX_TTFT_S)
        )
        if not valid:
            self.rejected += 1
            return False
        model = self.model(engine_id)
        self._refresh(engine_id, model)
        model.observe(float(uncached_tokens), int(queue_depth), float(ttft_s))
        self._dirty.add(engine_id)
        self._since_fleet_fit += 1
        if self._since_fleet_fit >= self.prior.fleet_refit_share * self._fleet_fit_weight:
            self._stale = True
        return True

    def forget(self, engine_id: str) -> None:
        """Drop what was learned about an engine that left (a replacement may be different hardware)."""
        if self._models.pop(engine_id, None) is not None:
            self._stale = True


def _fitted_params(a: float, b: float, c: float, d: float) -> TTFTParams:
    """Solved coefficients (prefill per ``_TOKEN_UNIT`` tokens) as parameters, each kept physical."""
    return TTFTParams(
        overhead_s=max(0.0, a),
        prefill_s_per_token=max(1e-9, b / _TOKEN_UNIT),
        batch_s_per_request=max(0.0, c),
        slot_wait_s_per_request=max(0.0, d),
    )


def _within(value: object, high: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= high
