"""Poisson sampling of users (sparta_tf.privacy.user_sampling): each user joins a step with probability q
whatever its size, contributes min(n_v, k) examples as one unit of k rows whose weights sum to one, a uniform
subset from its own stream; padding weighs zero; the draws follow (seed, step) only."""

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.privacy.user_sampling import UserPoissonSampler, dense_user_ids

# 12 users of sizes 1..12 (user v owns v + 1 examples), ids shuffled over the examples, as strings
SIZES = np.arange(1, 13)
RNG = np.random.default_rng(0)
USERS = RNG.permutation(np.repeat([f"patient-{v:02d}" for v in range(len(SIZES))], SIZES))


_TRACED = {}


def _units(sampler, step):
    """``{user: sorted example ids}`` of step ``step``'s units, checking the layout on the way (the draw
    traced once per sampler, as the dataset runs it)."""
    rows = _TRACED.setdefault(id(sampler), tf.function(sampler.padded_rows))
    indices, weights = (t.numpy() for t in rows(tf.constant(step, tf.int64)))
    k = sampler.examples_per_user
    assert len(indices) == len(weights) and len(indices) % (k * sampler.units_per_batch) == 0
    dense, _ = dense_user_ids(USERS)
    for unit in range(len(indices) // k):  # padding: the unit's first chosen example, example 0 in a padding unit
        unit_indices, unit_weights = indices[unit * k:(unit + 1) * k], weights[unit * k:(unit + 1) * k]
        expected_padding = unit_indices[0] if unit_weights[0] > 0 else 0
        assert np.all(unit_indices[unit_weights == 0] == expected_padding)
        assert np.all((unit_weights > 0)[:1] | (unit_weights == 0))  # a unit's chosen examples come first
    units = {}
    for unit in range(len(indices) // k):
        rows = slice(unit * k, (unit + 1) * k)
        real = weights[rows] > 0
        if not real.any():
            continue
        examples = indices[rows][real]
        (user,) = set(dense[examples])  # one user per unit
        assert user not in units
        assert real.sum() == min(SIZES[user], k) and np.allclose(weights[rows][real], 1 / real.sum())
        assert np.all(real[: real.sum()])  # its rows first, then padding
        units[user] = sorted(examples)
    return units


def test_every_user_joins_with_probability_q_whatever_its_size_and_brings_at_most_k_examples():
    q, k, steps = 0.3, 4, 400
    sampler = UserPoissonSampler(USERS, q, k, units_per_batch=3, seed=7)
    joined = np.zeros(len(SIZES))
    for step in range(steps):
        for user in _units(sampler, step):
            joined[user] += 1
    # binomial(400, 0.3): sd 9.2; 4.5 sd per user (12 users)
    assert np.all(np.abs(joined - q * steps) < 4.5 * np.sqrt(steps * q * (1 - q))), joined


def test_a_sampled_users_examples_are_a_uniform_subset_drawn_afresh_each_step():
    k, steps = 3, 300
    sampler = UserPoissonSampler(USERS, 1.0, k, seed=11)
    dense, _ = dense_user_ids(USERS)
    largest = int(np.argmax(SIZES))  # 12 examples, 3 taken: each with probability 1/4
    taken = np.zeros(len(USERS))
    subsets = set()
    for step in range(steps):
        examples = _units(sampler, step)[largest]
        taken[examples] += 1
        subsets.add(tuple(examples))
    mine = dense == largest
    p = k / SIZES[largest]
    assert np.all(np.abs(taken[mine] - p * steps) < 4.5 * np.sqrt(steps * p * (1 - p))), taken[mine]
    assert len(subsets) > 100  # fresh each step


def test_the_draws_follow_the_seed_and_the_step_only():
    a, b = UserPoissonSampler(USERS, 0.5, 2, seed=3), UserPoissonSampler(USERS, 0.5, 2, seed=3)
    for step in (0, 5, 17):
        for first, second in zip(a.padded_rows(step), b.padded_rows(step)):
            np.testing.assert_array_equal(first.numpy(), second.numpy())
    other = UserPoissonSampler(USERS, 0.5, 2, seed=4)
    assert any(_units(a, s) != _units(other, s) for s in range(5))


def test_the_dataset_yields_the_steps_rows_from_start_step():
    x = np.arange(len(USERS), dtype=np.float32)[:, None]
    y = np.arange(len(USERS))
    sampler = UserPoissonSampler(USERS, 0.5, 2, units_per_batch=2, seed=5)
    for t, (xs, ys, w) in enumerate(sampler.dataset(x, y, start_step=9).take(3), start=9):
        indices, weights = sampler.padded_rows(t)
        np.testing.assert_array_equal(ys.numpy(), indices.numpy())
        np.testing.assert_array_equal(xs.numpy()[:, 0], indices.numpy().astype(np.float32))
        np.testing.assert_array_equal(w.numpy(), weights.numpy())


def test_the_cap_reports_the_share_of_examples_it_leaves_out():
    sampler = UserPoissonSampler(USERS, 0.5, 4, seed=0)
    assert sampler.users == 12 and sampler.n == SIZES.sum()
    assert sampler.left_out == pytest.approx(np.maximum(SIZES - 4, 0).sum() / SIZES.sum())
    assert sampler.expected_batch_size == pytest.approx(6.0) and "seed=<hidden>" in repr(sampler)


@pytest.mark.parametrize("users, k, message", [
    (np.zeros((3, 2)), 2, r"one id per example \(a 1-D array\)"),
    (np.array([1.0, np.nan, 2.0]), 2, "1 non-finite ids"),
    (np.array(["a", None], dtype=object), 2, "None ids"),
    (np.array([1, 2]), 0, "examples_per_user"),
])
def test_bad_user_keys_and_caps_are_one_line(users, k, message):
    with pytest.raises(ValueError, match=message):
        UserPoissonSampler(users, 0.5, k, seed=0)


def test_data_of_another_length_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="one user id each"):
        UserPoissonSampler(USERS, 0.5, 2, seed=0).dataset(np.zeros((3, 1)), np.zeros(3))
