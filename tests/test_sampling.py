"""Tests for sparta_tf.privacy.sampling (Poisson sampling input pipeline)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from sparta_tf.privacy import sampling
from sparta_tf.privacy.sampling import (
    POISSON_DOMAIN,
    PoissonSampler,
    default_physical_batch_size,
    poisson_dataset,
    steps_per_epoch,
)
from sparta_tf.privacy.shuffling import shuffled_dataset, shuffled_steps_per_epoch

Z = 5.0  # z-score bound for the statistical tests (two-sided p ~ 6e-7)


def _ids_data(n: int):
    """x = example ids (so batches can be decoded), y = 10 * ids."""
    ids = np.arange(n, dtype=np.int64)
    return ids, 10 * ids


def _take(ds: tf.data.Dataset, count: int):
    return [tuple(tf.nest.map_structure(lambda t: t.numpy(), e)) for e in ds.take(count)]


def _reference_mask(seed: int, step: int, n: int, q: float) -> np.ndarray:
    """The documented Bernoulli draw, recomputed without the sampler's code."""
    step_seed = tf.random.experimental.stateless_fold_in(
        tf.constant([seed, POISSON_DOMAIN], tf.int64), tf.constant(step, tf.int64), alg="philox"
    )
    u = tf.random.stateless_uniform([n], seed=step_seed, dtype=tf.float64, alg="philox")
    return (u.numpy() < q)


def _real_ids(element) -> np.ndarray:
    x, _, w = element
    return x[w == 1.0]


# --------------------------------------------------------------------------
# Statistics of the Poisson draw
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inclusion_matrix():
    """[T, n] bool inclusion indicators decoded from T dataset elements."""
    n, q, T = 200, 0.1, 2000
    x, y = _ids_data(n)
    ds = poisson_dataset(x, y, q, physical_batch_size=48, seed=1234)
    incl = np.zeros((T, n), dtype=bool)
    for t, e in enumerate(_take(ds, T)):
        incl[t, _real_ids(e)] = True
    return incl, n, q, T


def test_sample_size_mean_and_variance_match_binomial(inclusion_matrix):
    incl, n, q, T = inclusion_matrix
    m = incl.sum(axis=1).astype(np.float64)
    mu, var = n * q, n * q * (1 - q)
    z_mean = (m.mean() - mu) / math.sqrt(var / T)
    assert abs(z_mean) < Z, z_mean
    # Var of the sample variance of T iid draws: (mu4 - var^2 (T-3)/(T-1)) / T,
    # with the binomial 4th central moment mu4 = var (1 + 3 (n - 2) q (1 - q)).
    mu4 = var * (1 + 3 * (n - 2) * q * (1 - q))
    sd_s2 = math.sqrt((mu4 - var**2 * (T - 3) / (T - 1)) / T)
    z_var = (m.var(ddof=1) - var) / sd_s2
    assert abs(z_var) < Z, z_var


def test_per_example_inclusion_frequencies_match_q(inclusion_matrix):
    incl, n, q, T = inclusion_matrix
    counts = incl.sum(axis=0)
    expected, sd = T * q, math.sqrt(T * q * (1 - q))
    # chi-square goodness of fit of n Binomial(T, q) counts, both tails
    chi2 = float((((counts - expected) / sd) ** 2).sum())
    p_hi, p_lo = stats.chi2.sf(chi2, df=n), stats.chi2.cdf(chi2, df=n)
    assert min(p_hi, p_lo) > 1e-6, (chi2, n)
    # and no single example far off (Bonferroni over n examples)
    z_max = np.abs(counts - expected).max() / sd
    assert z_max < stats.norm.isf(1e-6 / (2 * n)), z_max


def test_inclusions_of_different_examples_are_independent(inclusion_matrix):
    incl, n, q, T = inclusion_matrix
    a = incl.astype(np.float64)
    a = (a - a.mean(axis=0)) / a.std(axis=0)
    corr = (a.T @ a) / T  # under independence each off-diagonal ~ N(0, 1/T)
    off = corr[~np.eye(n, dtype=bool)]
    n_pairs = n * (n - 1) // 2
    bound = stats.norm.isf(1e-6 / (2 * n_pairs)) / math.sqrt(T)
    assert np.abs(off).max() < bound, (np.abs(off).max(), bound)
    # a specific pair: 2x2 contingency table of examples 0 and 1
    table = np.array(
        [[np.sum(incl[:, 0] & incl[:, 1]), np.sum(incl[:, 0] & ~incl[:, 1])],
         [np.sum(~incl[:, 0] & incl[:, 1]), np.sum(~incl[:, 0] & ~incl[:, 1])]]
    )
    assert stats.fisher_exact(table).pvalue > 1e-6, table


# --------------------------------------------------------------------------
# Padding, weights, no dropping
# --------------------------------------------------------------------------


def test_padding_weights_and_exact_sample_against_reference_draw():
    n, q, P, seed = 40, 0.5, 4, 99  # m ~ 20 >> P: k ~ 5 micro-batches
    x, y = _ids_data(n)
    sampler = PoissonSampler(n, q, P, seed=seed)
    saw_k_gt_1 = False
    for t, (xb, yb, w) in enumerate(_take(sampler.dataset(x, y), 30)):
        mask = _reference_mask(seed, t, n, q)
        m = int(mask.sum())
        k = max(1, -(-m // P))
        saw_k_gt_1 |= k > 1
        assert w.dtype == np.float32 and xb.shape == (k * P,) and yb.shape == (k * P,)
        assert len(w) % P == 0
        assert set(np.unique(w)) <= {0.0, 1.0}
        assert w.sum() == m
        # real rows first, in increasing id order, exactly the Bernoulli draw
        np.testing.assert_array_equal(w[:m], 1.0)
        np.testing.assert_array_equal(w[m:], 0.0)
        np.testing.assert_array_equal(xb[:m], np.flatnonzero(mask))
        np.testing.assert_array_equal(yb, 10 * xb)  # labels travel with features
        np.testing.assert_array_equal(xb[m:], 0)  # padding repeats example 0
        np.testing.assert_array_equal(sampler.sample_mask(t).numpy(), mask)
    assert saw_k_gt_1


def test_empty_sample_gives_one_all_padding_batch():
    n, q, P = 5, 1e-3, 3
    x = {"img": np.arange(n * 4, dtype=np.float32).reshape(n, 2, 2), "id": np.arange(n)}
    y = np.arange(n)
    elements = _take(PoissonSampler(n, q, P, seed=7).dataset(x, y), 20)
    empties = [e for e in elements if e[2].sum() == 0]
    assert empties, "expected some empty samples at q = 1e-3"
    for xb, yb, w in empties:
        assert w.shape == (P,) and np.all(w == 0.0)
        assert xb["img"].shape == (P, 2, 2) and yb.shape == (P,)


def test_nested_features_and_full_rate():
    n, P = 6, 4
    x = {"img": np.random.default_rng(0).integers(0, 255, (n, 3, 3, 2), dtype=np.uint8),
         "id": np.arange(n, dtype=np.int32)}
    y = (np.arange(n), np.arange(n) * 2.0)
    ds = poisson_dataset(x, y, 1.0, P, seed=0)  # q = 1: everyone, k = 2
    spec = ds.element_spec
    assert spec[0]["img"].shape.as_list() == [None, 3, 3, 2] and spec[2].shape.as_list() == [None]
    (xb, yb, w), = _take(ds, 1)
    assert w.tolist() == [1.0] * n + [0.0] * 2
    np.testing.assert_array_equal(xb["id"][:n], np.arange(n))
    np.testing.assert_array_equal(xb["img"][:n], x["img"])
    np.testing.assert_array_equal(yb[1][:n], 2.0 * np.arange(n))


# --------------------------------------------------------------------------
# Determinism and resumption
# --------------------------------------------------------------------------


def _assert_same(a, b):
    assert len(a) == len(b)
    for ea, eb in zip(a, b):
        for la, lb in zip(tf.nest.flatten(ea), tf.nest.flatten(eb)):
            np.testing.assert_array_equal(la, lb)


def test_same_seed_same_batches_and_resume_reproduces_tail():
    n, q, P = 50, 0.2, 8
    x, y = _ids_data(n)
    full = _take(poisson_dataset(x, y, q, P, seed=2024), 25)
    again = _take(poisson_dataset(x, y, q, P, seed=2024), 25)
    _assert_same(full, again)
    tail = _take(poisson_dataset(x, y, q, P, seed=2024, start_step=17), 8)
    _assert_same(full[17:], tail)
    other = _take(poisson_dataset(x, y, q, P, seed=2025), 25)
    assert any(not np.array_equal(_real_ids(a), _real_ids(b)) for a, b in zip(full, other))


def test_seed_policy_none_draws_secret_63_bit_seed():
    a, b = PoissonSampler(10, 0.5), PoissonSampler(10, 0.5)
    assert 0 <= a.seed < 2**63 and a.seed != b.seed
    assert str(a.seed) not in repr(a)
    # the stored seed reproduces the sampler exactly
    c = PoissonSampler(10, 0.5, seed=a.seed)
    for t in range(5):
        np.testing.assert_array_equal(a.sample_mask(t).numpy(), c.sample_mask(t).numpy())


# --------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------


def test_sizes():
    assert steps_per_epoch(0.005) == 200
    assert steps_per_epoch(1.0) == 1 and steps_per_epoch(0.9) == 1
    s = PoissonSampler(50_000, 0.01, seed=0)
    assert s.steps_per_epoch == 100 and s.expected_batch_size == pytest.approx(500.0)
    n, q = 50_000, 0.01
    p = default_physical_batch_size(n, q)
    assert p == math.ceil(500 + 4 * math.sqrt(n * q * (1 - q)))  # 589
    assert s.physical_batch_size == p
    p8 = default_physical_batch_size(n, q, multiple_of=8)
    assert p8 % 8 == 0 and p <= p8 < p + 8
    assert default_physical_batch_size(10, 1.0) == 10
    assert default_physical_batch_size(10, 1.0, multiple_of=4) == 12
    assert default_physical_batch_size(1000, 1e-6) == 1
    assert shuffled_steps_per_epoch(10, 4) == 3
    assert shuffled_steps_per_epoch(10, 4, drop_remainder=True) == 2


# --------------------------------------------------------------------------
# Shuffled batches
# --------------------------------------------------------------------------


def test_shuffled_dataset_covers_each_example_once_per_epoch():
    n, B = 10, 4
    x, y = _ids_data(n)
    ds = shuffled_dataset(x, y, B, seed=5)
    assert ds.element_spec[0].shape.as_list() == [B]
    els = _take(ds, 3 * 3)
    epochs = []
    for e in range(3):
        batch = els[3 * e: 3 * e + 3]
        for xb, yb, w in batch:
            assert xb.shape == (B,) and w.shape == (B,)
            np.testing.assert_array_equal(yb, 10 * xb)
        np.testing.assert_array_equal(batch[0][2], 1.0)
        np.testing.assert_array_equal(batch[-1][2], [1.0, 1.0, 0.0, 0.0])
        ids = np.concatenate([_real_ids(b) for b in batch])
        np.testing.assert_array_equal(np.sort(ids), np.arange(n))
        epochs.append(ids)
    assert not all(np.array_equal(epochs[0], ep) for ep in epochs[1:])  # reshuffled
    # resume mid-epoch reproduces the tail; drop_remainder keeps 8 distinct ids
    _assert_same(els[4:], _take(shuffled_dataset(x, y, B, seed=5, start_step=4), 5))
    dropped = _take(shuffled_dataset(x, y, B, seed=5, drop_remainder=True), 2)
    ids = np.concatenate([b[0] for b in dropped])
    assert len(set(ids.tolist())) == 8 and all(np.all(b[2] == 1.0) for b in dropped)


def test_shuffled_docstring_warns_about_accountant():
    doc = shuffled_dataset.__doc__
    assert "does NOT cover" in doc and "Poisson" in doc


# --------------------------------------------------------------------------
# Keras integration and validation
# --------------------------------------------------------------------------


def test_keras_fit_consumes_triples():
    n = 32
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 2, n)
    sampler = PoissonSampler(n, 0.25, 8, seed=3)
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    model.compile("sgd", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(sampler.dataset(x, y), epochs=1, steps_per_epoch=3, verbose=0)
    assert np.isfinite(hist.history["loss"][0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, y: poisson_dataset(x, y, 0.0, 4), "sample_rate"),
        (lambda x, y: poisson_dataset(x, y, 1.5, 4), "sample_rate"),
        (lambda x, y: poisson_dataset(x, y, float("nan"), 4), "sample_rate"),
        (lambda x, y: poisson_dataset(x, y, 0.1, 0), "physical_batch_size"),
        (lambda x, y: poisson_dataset(x, y[:-1], 0.1, 4), "x has 10 examples but y has 9"),
        (lambda x, y: poisson_dataset(x[:0], y[:0], 0.1, 4), "0 examples"),
        (lambda x, y: poisson_dataset({"a": x, "b": x[:3]}, y, 0.1, 4), "leaves of x"),
        (lambda x, y: poisson_dataset(x, y, 0.1, 4, seed=-1), "seed"),
        (lambda x, y: poisson_dataset(x, y, 0.1, 4, start_step=-1), "start_step"),
        (lambda x, y: PoissonSampler(11, 0.1, 4).dataset(x, y), "n=11"),
        (lambda x, y: shuffled_dataset(x, y, 0), "batch_size"),
        (lambda x, y: shuffled_dataset(x, y, 20, drop_remainder=True), "drop_remainder"),
        (lambda x, y: default_physical_batch_size(10, 0.1, multiple_of=0), "multiple_of"),
        (lambda x, y: steps_per_epoch(-0.1), "sample_rate"),
    ],
)
def test_validation_errors(call, match):
    x, y = _ids_data(10)
    with pytest.raises(ValueError, match=match):
        call(x, y)


def test_all_exports_exist():
    for name in sampling.__all__:
        assert hasattr(sampling, name)
