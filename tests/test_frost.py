"""Tests of DP-FROST (sparta_tf.selection.frost)."""

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.privacy import accounting
from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.selection import frost, frost_magnitudes, pgm
from small_models import gaussian_data


# ----------------------------------------------------------------- mechanisms


def test_sensitivities_follow_lemma_3():
    sizes = [4, 12, 32]
    for alpha in (1, 2):
        assert frost_magnitudes.pgm_sensitivity(sizes, "mg", alpha, 2.0) == pytest.approx(2.0 / 4 ** (1 / alpha))
        for m in ("mgn", "mgna"):
            assert frost_magnitudes.pgm_sensitivity(sizes, m, alpha, 2.0) == pytest.approx(2.0 / 16 ** (1 / alpha))


@pytest.mark.parametrize("method", frost_magnitudes.METHODS)
@pytest.mark.parametrize("alpha", [1, 2])
def test_one_example_moves_mu_by_at_most_the_sensitivity(method, alpha):
    rng = np.random.default_rng(0)
    sizes = [3, 10, 25]
    worst = 0.0
    for _ in range(200):
        base = [rng.normal(size=(5, n)) for n in sizes]
        extra = [rng.normal(size=(1, n)) * rng.exponential(10.0) for n in sizes]
        mu0, sens = frost_magnitudes.partition_magnitudes(base, method, alpha, 1.0)
        mu1, _ = frost_magnitudes.partition_magnitudes([np.concatenate([b, e]) for b, e in zip(base, extra)], method, alpha, 1.0)
        worst = max(worst, np.linalg.norm(mu1 - mu0) / sens)
    assert worst <= 1.0 + 1e-9


def test_mgna_of_small_gradients_is_normalised_abs_norm():
    # Two examples whose gradients cancel: abs keeps their magnitude, DP-MGN does not.
    g = [np.array([[0.001, -0.002], [-0.001, 0.002]]), np.array([[0.003, 0.0, -0.001, 0.0], [0.0] * 4])]
    mu, _ = frost_magnitudes.partition_magnitudes(g, "mgna", 1, 1.0)  # no clipping at this scale
    np.testing.assert_allclose(mu, [0.006 / 2, 0.004 / 4])
    mu_n, _ = frost_magnitudes.partition_magnitudes(g, "mgn", 1, 1.0)
    np.testing.assert_allclose(mu_n, [0.0, 0.004 / 4], atol=1e-15)
    mu_c, _ = frost_magnitudes.partition_magnitudes(g, "mg", 2, 1.0)
    np.testing.assert_allclose(mu_c, [0.0, np.sqrt(0.003**2 + 0.001**2) / 2], atol=1e-15)


# ----------------------------------------------------------------- PGM-EST


def _simulate(rng, v, sigma, q, t_max=5, drop=3):
    """Observations of a PSEL-like run: each round drops the `drop` largest remaining partitions."""
    m = len(v)
    remaining = np.arange(m)
    rows, deltas, lam_true = [], [], []
    for t in range(t_max):
        lam = q * (1.0 + 0.15 * t)  # removing partitions makes the remaining PGMs grow (Lemma 1)
        delta = 1.0 / (1.0 + 0.1 * t)
        row = np.full(m, np.nan)
        row[remaining] = lam * v[remaining] + rng.normal(0, sigma * delta, size=remaining.size)
        rows.append(row)
        deltas.append(delta)
        lam_true.append(lam)
        remaining = remaining[np.argsort(row[remaining])][:-drop]
    return np.stack(rows), deltas, remaining


def test_pgm_est_beats_single_shot_estimate():
    rng = np.random.default_rng(1)
    q, sigma, m = 0.02, 0.02, 40
    err_mle, err_single = [], []
    for _ in range(60):
        v = rng.uniform(0.5, 3.0, size=m)
        obs, deltas, remaining = _simulate(rng, v, sigma, q)
        est, lam = pgm.pgm_est(obs, deltas, q_ps=q, iterations=1000)
        single = obs[0] / q
        err_mle.append(np.mean((est[remaining] - v[remaining]) ** 2))
        err_single.append(np.mean((single[remaining] - v[remaining]) ** 2))
    assert np.mean(err_mle) < 0.5 * np.mean(err_single)


def test_pgm_est_first_round_and_fixed_point():
    obs = np.array([[0.02, 0.04, 0.06]])
    v, lam = pgm.pgm_est(obs, [1.0], q_ps=0.02)
    np.testing.assert_allclose(v, [1.0, 2.0, 3.0])
    # Noise-free rank-one data: exact recovery, lambda_2 recovered.
    v_true = np.array([1.0, 2.0, 3.0, 4.0])
    obs = np.stack([0.02 * v_true, 0.05 * v_true])
    obs[1, 3] = np.nan
    v, lam = pgm.pgm_est(obs, [1.0, 0.5], q_ps=0.02)
    np.testing.assert_allclose(v, v_true, rtol=1e-6)
    np.testing.assert_allclose(lam, [0.02, 0.05], rtol=1e-6)


def test_pgm_variance_matches_lemma_6_empirically():
    # Lemma 6 treats the lambdas as known constants: check it for the Lemma 5 estimator.
    rng = np.random.default_rng(2)
    q, sigma, m = 0.02, 0.01, 30
    v = rng.uniform(1.0, 2.0, size=m)
    lam, deltas = np.array([q, 0.03, 0.04]), [1.0, 0.8, 0.6]
    observed = np.ones((3, m), bool)
    observed[1:, :5] = False  # partitions selected after round 1 are observed once
    ests = []
    for _ in range(2000):
        obs = lam[:, None] * v[None] + rng.normal(size=(3, m)) * sigma * np.array(deltas)[:, None]
        ests.append(pgm.pgm_given_lambdas(np.where(observed, obs, np.nan), deltas, lam))
    predicted = pgm.pgm_variance(sigma, lam, deltas, observed)
    empirical = np.var(np.stack(ests), axis=0)
    np.testing.assert_allclose(empirical / predicted, 1.0, atol=0.15)
    assert predicted[0] > predicted[-1]


# ----------------------------------------------------------------- PSEL


@pytest.mark.parametrize("gamma", [0.05, 0.2, 0.5, 0.9])
def test_psel_never_exceeds_gamma_theta(gamma):
    rng = np.random.default_rng(3)
    for trial in range(30):
        m = int(rng.integers(3, 30))
        sizes = rng.integers(1, 500, size=m)
        total = int(sizes.sum() + rng.integers(0, 200))  # Theta may hold unpartitioned parameters
        v = rng.exponential(1.0, size=m)

        def observe(t, remaining):
            return 0.02 * v[remaining] + rng.normal(0, 0.01, size=remaining.size), 1.0

        chosen, info = frost.psel(observe, sizes, total, 0.01, gamma, iterations=5, nu=float(rng.uniform(0, 5)))
        assert sizes[chosen].sum() <= gamma * total
        assert len(set(chosen.tolist())) == len(chosen)
        assert info["rounds"] <= 5


def test_psel_picks_the_largest_partitions_without_noise():
    sizes = np.full(10, 10)
    v = np.arange(10, dtype=float)
    chosen, _ = frost.psel(lambda t, r: (0.02 * v[r], 1.0), sizes, 100, 1e-6, 0.3, iterations=3, nu=5.0)
    assert sorted(chosen.tolist()) == [7, 8, 9]


def test_psel_that_ranks_a_too_large_partition_first_selects_none_and_says_why():
    sizes = np.array([60, 10, 10, 10, 10])  # the largest magnitude is on a partition above the budget
    v = np.array([5.0, 1.0, 2.0, 3.0, 4.0])
    chosen, _ = frost.psel(lambda t, r: (0.02 * v[r], 1.0), sizes, 100, 1e-6, 0.3, iterations=3, nu=5.0)
    assert chosen.size == 0  # PSEL stops at the first partition that does not fit, as the paper's loop does
    message = frost.no_partition_message(sizes, 100, 0.3)
    assert "PSEL stops there" in message and "smaller than" not in message


def test_no_partition_message_names_the_gamma_every_partition_needs():
    message = frost.no_partition_message([60, 25, 40], 200, 0.1)
    assert "fewer than the smallest partition (25)" in message and "at least 0.125" in message


# ----------------------------------------------------------------- accounting


@pytest.mark.parametrize("eps,q,steps", [(1.0, 0.01, 100), (4.0, 0.05, 50)])
def test_compute_sigmas_spends_the_budget(eps, q, steps):
    delta = 1e-5
    sig_sel, sig_sgd = frost.compute_sigmas(eps, delta, 0.9, sample_rate=q, steps=steps,
                                            selection_rate=0.02, selection_steps=5)
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(sig_sel)), 5),
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sig_sgd)), steps),
    ])
    spent = accounting.make_accountant("pld").compose(event).get_epsilon(delta)
    assert 0.99 * eps <= spent <= eps
    training_only = accounting.compute_epsilon(sig_sgd, q, steps, delta)
    assert training_only <= 0.9 * eps + 1e-9


def test_ledger_records_selection_mechanisms():
    ledger = PrivacyLedger(delta=1e-5)
    frost.record_selection(ledger, 3.5, 0.02, 5)
    ledger.record(1.2, 0.01, 100)
    sel = [e for e in ledger.entries if e.phase == "frost_selection"]
    assert len(sel) == 1
    assert (sel[0].noise_multiplier, sel[0].sample_rate, sel[0].count) == (3.5, 0.02, 5)


# ----------------------------------------------------------------- end to end


def _tiny_model():
    tf.keras.utils.set_random_seed(0)
    inputs = tf.keras.Input((6,))
    h = tf.keras.layers.Dense(16, activation="relu", name="d1")(inputs)
    h = tf.keras.layers.Dense(8, activation="relu", name="d2")(h)
    out = tf.keras.layers.Dense(3, name="head")(h)
    return tf.keras.Model(inputs, out)


def test_frost_select_on_tiny_model():
    model = _tiny_model()
    x, y = gaussian_data(400, (6,), 3)
    ledger = PrivacyLedger(delta=1e-4)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    selected, info = frost.frost_select(
        model, x, y, loss, target_epsilon=2.0, delta=1e-4, sample_rate=0.1, steps=20,
        gamma=0.5, q_ps=0.25, pgm_iterations=50, ledger=ledger, seed=0,
    )
    total = model.count_params()
    assert info["total_params"] == total
    assert info["selected_params"] == selected.size <= 0.5 * total
    # Whole partitions: a kernel is selected iff its bias is.
    names = {v.name for v in selected.variables}
    for layer in ("d1", "d2", "head"):
        assert (f"{layer}/kernel:0" in names) == (f"{layer}/bias:0" in names)
    assert all(s.kind == "dense" for s in selected)
    entry = [e for e in ledger.entries if e.phase == "frost_selection"][0]
    assert entry.sample_rate == 0.25 and entry.noise_multiplier == info["sigma_selection"]
    assert entry.count == info["rounds"]
    ledger.record(info["sigma_training"], 0.1, 20)
    assert ledger.epsilon() <= 2.0 + 1e-6
