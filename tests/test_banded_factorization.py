"""BandMF's factorization (``sparta_tf.privacy.banded``) against direct linear algebra.

* ``b = 1`` is DP-SGD: ``C = I``, the noise passes unchanged;
* ``C`` is lower-triangular Toeplitz with ``b`` bands and unit column norm, and columns ``b`` or
  more steps apart have disjoint support (what the cyclic-Poisson reduction needs);
* the forward substitution is ``C^{-1} z``; the untruncated coefficients square to the workload's
  generating function (plain SGD and momentum);
* the workload matrix is what SGD with momentum does to unit impulses;
* the cyclic rate, the reduced step count and their refusals;
* at one target epsilon the banded noise on the final iterate beats DP-SGD's at epsilon 8 and
  not at epsilon 2 (the reduction's calibrated sigma; T = 400, q = 0.05, n = 5000).
"""

import numpy as np
import pytest

from sparta_tf.privacy.banded import (
    BandedFactorization,
    banded_sqrt_coefficients,
    reduced_steps,
    sqrt_series,
    workload,
)
from sparta_tf.privacy.calibration import calibrate_noise_multiplier
from sparta_tf.privacy.plan import cyclic_sample_rate

T = 24


def test_one_band_is_independent_noise():
    factorization = BandedFactorization(1)
    assert factorization.coefficients.tolist() == [1.0]
    assert np.array_equal(factorization.matrix(T), np.eye(T))
    z = np.random.default_rng(0).normal(size=(T, 5))
    assert np.array_equal(factorization.correlate(z), z)


@pytest.mark.parametrize("bands", [2, 3, 8])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_strategy_is_banded_toeplitz_with_unit_columns_and_disjoint_far_columns(bands, momentum):
    strategy = BandedFactorization(bands, momentum).matrix(T)
    assert np.array_equal(strategy, np.tril(strategy)) and np.all(np.diag(strategy) > 0)
    rows, cols = np.nonzero(strategy)
    assert np.all(rows - cols < bands)
    assert np.allclose(np.diag(strategy, -1)[:-1], np.diag(strategy, -1)[1:])  # Toeplitz
    norms = np.linalg.norm(strategy, axis=0)
    assert np.isclose(norms.max(), 1.0, atol=1e-12) and np.all(norms <= 1.0 + 1e-12)
    for s in range(T):
        for far in range(s + bands, T):
            assert not np.any(strategy[:, s] * strategy[:, far])


@pytest.mark.parametrize("bands", [2, 5, 8])
def test_correlate_is_the_inverse_of_the_strategy(bands):
    factorization = BandedFactorization(bands, 0.5)
    z = np.random.default_rng(1).normal(size=(T, 3, 2))
    expected = np.linalg.solve(factorization.matrix(T), z.reshape(T, -1)).reshape(z.shape)
    assert np.allclose(factorization.correlate(z), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_untruncated_coefficients_square_to_the_workload(momentum):
    c = sqrt_series(T, momentum)
    squared = np.convolve(c, c)[:T]
    k = np.arange(T)
    expected = np.ones(T) if momentum == 0 else (1 - momentum ** (k + 1)) / (1 - momentum)
    assert np.allclose(squared, expected, rtol=1e-12)
    assert np.allclose(banded_sqrt_coefficients(4, momentum), c[:4] / np.linalg.norm(c[:4]))


def test_the_workload_is_sgd_with_momentum_on_unit_impulses():
    rates = np.linspace(1.0, 0.1, T)
    momentum = 0.8
    a = workload(T, momentum, rates)
    for s in range(T):  # gradient 1 at step s only: the iterates' movement
        velocity, theta, moved = 0.0, 0.0, []
        for t in range(T):
            velocity = momentum * velocity + (1.0 if t == s else 0.0)
            theta += rates[t] * velocity
            moved.append(theta)
        assert np.allclose(a[:, s], moved)
    assert np.array_equal(workload(5), np.tril(np.ones((5, 5))))


def test_cyclic_rate_and_reduced_steps():
    assert cyclic_sample_rate(0.05, 1) == 0.05
    assert cyclic_sample_rate(0.05, 8) == pytest.approx(0.4)
    assert cyclic_sample_rate(0.05, 20) == 1.0  # b = 1/q: every example of the step's group
    assert reduced_steps(400, 8) == 50 and reduced_steps(401, 8) == 51 and reduced_steps(7, 1) == 7
    with pytest.raises(ValueError, match=r"^bands=32 needs a sampling rate of 1\.6 per group[^\n]*keep bands <= 20"):
        cyclic_sample_rate(0.05, 32)
    with pytest.raises(ValueError, match=r"^bands=0 must be an integer >= 1"):
        reduced_steps(10, 0)


def test_banded_noise_beats_dp_sgd_at_epsilon_8_and_not_at_epsilon_2():
    steps, q = 400, 0.05
    ratios = {}
    for epsilon, bands in ((8.0, 8), (2.0, 2)):
        dp_sgd = calibrate_noise_multiplier(epsilon, 1e-5, q, steps) * np.sqrt(steps)
        sigma = calibrate_noise_multiplier(epsilon, 1e-5, cyclic_sample_rate(q, bands), reduced_steps(steps, bands))
        ratios[epsilon] = sigma * BandedFactorization(bands).final_iterate_noise(steps) / dp_sgd
    assert ratios[8.0] < 0.95 and ratios[2.0] > 1.0


@pytest.mark.parametrize("bands, momentum", [(1, 0.0), (4, 0.0), (5, 0.9)])
def test_the_final_iterate_noise_by_back_substitution_is_the_matrix_solution(bands, momentum):
    factorization = BandedFactorization(bands, momentum)
    direct = factorization.final_iterate_noise(37, workload(37, momentum))
    assert factorization.final_iterate_noise(37) == pytest.approx(direct, rel=1e-10)
    if bands == 1 and momentum == 0:
        assert direct == pytest.approx(np.sqrt(37))  # DP-SGD: ||A_T|| = sqrt(T)
