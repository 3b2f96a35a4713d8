"""How far engines of one fleet really differ, judged from their own fits (random-effects meta-analysis, sans-IO).

Each engine's learned speed is its own data pulled toward the fleet's. How hard to pull should not be a fixed
number of observations: on a loaded machine the noise of a few dozen TTFTs made ten identical engines' learned
prefill of one 2,000-token prefix range 123-165 ms and their decode 317-420 ms, differences larger than the
crowding (13-28 ms) and displacement (27-30 ms) terms that should spread new prefixes, so new prefixes piled onto
the engines that had served. A fixed heavier pull fixes the twins but keeps a really slower engine from being
learned. The between-engine variance below is what the engines' estimates scatter beyond their own sampling
noise (DerSimonian-Laird): zero for twins, whatever their noise, and as large as the real difference once the
data show one. The learners use it as the spread of an engine around its fleet, so a difference counts only
as far as it is statistically there.
"""

from __future__ import annotations

import numpy as np


def between_engine_variance(estimates: np.ndarray, variances: np.ndarray) -> np.ndarray:
    """Per coefficient, the variance of the engines' true values around their common mean.

    ``estimates`` and ``variances`` are (engines, coefficients): each engine's own estimate and its sampling
    variance. Q, the precision-weighted scatter of the estimates, is about ``engines - 1`` when they differ only
    by noise; when it is significantly more, the excess, scaled by the weights, is the real spread. Fewer than
    two engines, or no finite positive variance, say nothing: zero. Never NaN; infinite when the scatter
    overflows (engines as different as can be)."""
    estimates = np.asarray(estimates, dtype=float)
    variances = np.asarray(variances, dtype=float)
    if estimates.ndim != 2 or estimates.shape[0] < 2:
        return np.zeros(estimates.shape[-1] if estimates.ndim else 0)
    with np.errstate(all="ignore"):
        tau2 = _dersimonian_laird(estimates, variances)
    return np.where(np.isnan(tau2), 0.0, np.maximum(tau2, 0.0))


def _dersimonian_laird(estimates: np.ndarray, variances: np.ndarray) -> np.ndarray:
    usable = np.isfinite(estimates) & np.isfinite(variances) & (variances > 0)
    weights = np.where(usable, 1.0 / np.where(usable, variances, 1.0), 0.0)
    values = np.where(usable, estimates, 0.0)
    s1 = weights.sum(axis=0)
    s2 = (weights * weights).sum(axis=0)
    counted = usable.sum(axis=0)
    safe_s1 = np.where(s1 > 0, s1, 1.0)
    mean = (weights * values).sum(axis=0) / safe_s1
    q = (weights * (values - mean) ** 2).sum(axis=0)
    scale = s1 - s2 / safe_s1
    dof = np.maximum(counted - 1, 1)
    real = (counted >= 2) & (scale > 0) & (q > chi2_quantile(dof, SIGNIFICANCE_Z))
    return np.where(real, (q - dof) / np.where(scale > 0, scale, 1.0), 0.0)


SIGNIFICANCE_Z = 2.326
"""One-sided 1%: engines' scatter within what noise gives 99 times in 100 is taken as no difference at all (a
learner tests each coefficient, and refits after every answer, so a looser test frees twins often). The plain
estimate, positive whenever Q exceeds its mean, made four noisy twins look 6 ms apart on a 110 ms prefill
(40% noise, 29 TTFTs each); with the test, under 1 ms in most fleets."""


def chi2_quantile(dof: np.ndarray, z: float) -> np.ndarray:
    """The chi-square quantile at normal deviate ``z`` (Wilson-Hilferty; within 1% from 2 degrees of freedom)."""
    k = np.asarray(dof, dtype=float)
    return k * (1 - 2 / (9 * k) + z * np.sqrt(2 / (9 * k))) ** 3
