"""Between-engine variance: zero while engines scatter only as their noise explains, the real spread otherwise."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.pooling import between_engine_variance


@settings(max_examples=20, deadline=None, derandomize=True)  # a 1% test over 400 draws: no flaky seeds
@given(st.integers(2, 40), st.floats(1e-4, 1.0), st.integers(0, 2**32))
def test_twins_whose_estimates_scatter_within_their_noise_mostly_show_no_spread(engines, sd, seed):
    rng = np.random.default_rng(seed)
    draws = [between_engine_variance(rng.normal(5.0, sd, (engines, 1)), np.full((engines, 1), sd * sd))[0]
             for _ in range(400)]
    # Taken as real only beyond the one-sided 1% of the noise (Wilson-Hilferty's error adds a little).
    assert np.mean(np.array(draws) > 0) <= 0.03


def test_a_real_spread_is_recovered_once_it_exceeds_the_noise():
    rng = np.random.default_rng(1)
    true = rng.normal(0.0, 1.0, (400, 1))
    estimates = true + rng.normal(0.0, 0.3, (400, 1))
    tau2 = between_engine_variance(estimates, np.full((400, 1), 0.09))[0]
    assert abs(tau2 - float(np.var(true))) <= 0.2


@given(st.lists(st.tuples(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True,
                                                                                     allow_infinity=True)),
                max_size=6))
def test_any_input_gives_a_nonnegative_spread_never_nan(pairs):
    estimates = np.array([[e] for e, _ in pairs]).reshape(len(pairs), 1)
    variances = np.array([[v] for _, v in pairs]).reshape(len(pairs), 1)
    out = between_engine_variance(estimates, variances)
    assert out.shape == (1,) and not np.any(np.isnan(out)) and np.all(out >= 0)
