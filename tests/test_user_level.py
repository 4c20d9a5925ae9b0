"""User-level DP (``unit="user"``) in the DP step, ``DPModel.fit`` and ``make_private``.

Checked against independent references:

* a user's unit is the mean of its chosen examples' gradients, clipped once: every engine (and
  augmentation multiplicity's views within a user) against one example at a time with
  ``tf.GradientTape``, with padding rows and padding units;
* adding one user with 1, 5 or 50 examples changes the clipped sum by at most ``C``, while the same
  examples at example level change it by up to ``m C`` (shown: more than ``C``);
* a user with a non-finite example is dropped as a whole, the others untouched;
* the mechanisms before training count users: DP-SNIP's sum is each user's mean connection gradient
  clipped once (against the tape, one example at a time), and one user of 1 to 50 examples moves it by at
  most ``C`` and a DP-FROST round's magnitudes by one unit's bound (the same examples at example level:
  more); DP-FROST and DP-SSGD with ``dp_snip`` train at user level through ``make_private``;
* the ledger of a user-level run equals a direct dp-accounting composition over ``U`` users at ``q``;
* ``unit="example"`` is the step without user units (bit-identical weights to the default);
* what user-level DP does not cover is refused in one line before anything is charged; the white-box
  audit draws canary users and stays below the claim;
* ``sparta-train`` with ``privacy.unit: user``: the dry run counts users and compares with example
  level; a run records the unit in its results and ledger; bad configs are one line;
* private tuning at user level: the score counts users (one user moves it by at most 1), and
  ``tune_privately`` / ``sparta-tune`` plan, train and score over users.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf.dp_step.clip import ClippedSum
from sparta_tf.dp_step.user_units import UserUnits
from sparta_tf.audit.white_box_run import audit_white_box
from sparta_tf.dp_step.views import AugmentationMultiplicity
from sparta_tf.per_example import make_engine
from sparta_tf.trainable import TrainableSet
from small_configs import DELETE, set_key, tiny_config
from two_replicas import two_cpu_replicas
from small_models import LOSS, PER_EXAMPLE_LOSS, conv_gn_model, gaussian_data, small_data, small_mlp
from sparta_tf.data import load_dataset
from sparta_tf.privacy.tuning import per_run_event, tuning_epsilon
from sparta_tf.tuning import procedure
from trainers import audit, cli, run, tune_cli
from trainers.config import ConfigError, validate

K_CAP = 3  # examples_per_user in the unit tests
CLIP = 0.05  # small enough that every unit is clipped


def _batch(examples_of_unit: list[list[int]], k: int = K_CAP):
    """``(indices, weights)`` of a batch laid out as UserPoissonSampler lays it out: ``k`` rows per unit,
    the unit's chosen examples with weight ``1 / k_v``, then padding rows (its first example, weight 0;
    example 0 in a padding unit)."""
    indices, weights = [], []
    for chosen in examples_of_unit:
        indices += list(chosen) + [chosen[0] if chosen else 0] * (k - len(chosen))
        weights += [1.0 / len(chosen)] * len(chosen) + [0.0] * (k - len(chosen)) if chosen else [0.0] * k
    return np.array(indices), np.array(weights, np.float32)


def _unit_statistic(model, engine_name, x, y, weights, k=K_CAP, views=None, clip=CLIP):
    """The step's clipped sum of a batch of user units (the rows the views made, and the usable units)."""
    units = UserUnits(k)
    engine = make_engine(model, TrainableSet.of_variables(model.trainable_variables), engine_name,
                         views=k * (1 if views is None else views.views))
    key = None if views is None else views.key(0, 0)
    rows, labels, valid, _ = units.group(tf.constant(x), tf.constant(y), tf.constant(weights), views, key)
    result = ClippedSum(clip)(engine, rows, labels, units.unit_loss(PER_EXAMPLE_LOSS), valid, None)
    return [s.numpy() for s in result.sums], rows.numpy(), valid.numpy()


def _clipped_reference(model, grads_of_units, clip=CLIP):
    """``sum_v min(1, C / ||g_v||) g_v`` over the units' gradients (lists of arrays)."""
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for grads in grads_of_units:
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
        factor = min(1.0, clip / norm) if norm > 0 else 0.0
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


def _tape_gradient(model, x_rows, y_rows):
    """The gradient of the mean loss over ``x_rows`` (one row at a time, averaged)."""
    grads = None
    for x_i, y_i in zip(x_rows, y_rows):
        with tf.GradientTape() as tape:
            loss = PER_EXAMPLE_LOSS(y_i[None], model(x_i[None], training=True))[0]
        g = [gr.numpy().astype(np.float64) for gr in tape.gradient(loss, model.trainable_variables)]
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    return [g / len(x_rows) for g in grads]


UNITS = [[1, 2, 3], [4], [5, 6], []]  # three users (3, 1 and 2 chosen examples) and a padding unit


@pytest.mark.parametrize("engine_name", ["bookkeeping", "layerwise", "vectorized"])
def test_a_users_unit_is_its_examples_mean_gradient_clipped_once(engine_name):
    model = conv_gn_model()
    x, y = gaussian_data(8, (6, 6, 2), 3)
    indices, weights = _batch(UNITS)
    ours, _, valid = _unit_statistic(model, engine_name, x[indices], y[indices], weights)
    assert valid.tolist() == [True, True, True, False]
    expected = _clipped_reference(model, [_tape_gradient(model, x[u], y[u]) for u in UNITS if u])
    for a, b in zip(ours, expected):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


def _jitter(example, seed):
    return example + 0.1 * tf.random.stateless_normal(tf.shape(example), seed)


@pytest.mark.parametrize("engine_name", ["bookkeeping", "vectorized"])
def test_views_are_drawn_within_a_user_and_averaged_before_the_users_clip(engine_name):
    model = small_mlp()
    x, y = small_data(8)
    indices, weights = _batch(UNITS)
    views = AugmentationMultiplicity(2, _jitter, seed=3)
    ours, rows, _ = _unit_statistic(model, engine_name, x[indices], y[indices], weights, views=views)
    labels = np.repeat(y[indices], 2)
    units = []
    for s, chosen in enumerate(UNITS):
        if chosen:  # unit s: rows (s k + j) K + v for its chosen j and both views v
            picked = [(s * K_CAP + j) * 2 + v for j in range(len(chosen)) for v in range(2)]
            units.append(_tape_gradient(model, rows[picked], labels[picked]))
    for a, b in zip(ours, _clipped_reference(model, units)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("examples", [1, 5, 50])
def test_one_user_moves_the_clipped_sum_by_at_most_C_while_its_examples_at_example_level_move_it_more(examples):
    model = small_mlp()
    x, y = small_data(8)
    others = [[0, 1], [2], [3, 4]]
    newcomer = [5] * examples  # one person, many (here identical) records: the worst case at example level
    k = max(examples, 2)
    without, _, _ = _unit_statistic(model, "bookkeeping", *_rows(x, y, others, k), k=k)
    with_user, _, _ = _unit_statistic(model, "bookkeeping", *_rows(x, y, others + [newcomer], k), k=k)
    change = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(with_user, without)))
    assert change <= CLIP * (1 + 1e-5)
    assert change > 0.5 * CLIP  # the user did contribute (its gradient norm is far above C)

    as_examples = [[i] for chosen in others for i in chosen]
    before, _, _ = _unit_statistic(model, "bookkeeping", *_rows(x, y, as_examples, 1), k=1)
    after, _, _ = _unit_statistic(model, "bookkeeping", *_rows(x, y, as_examples + [[5]] * examples, 1), k=1)
    example_change = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(after, before)))
    np.testing.assert_allclose(example_change, examples * change, rtol=1e-4)  # m records: m clipped units
    if examples > 1:
        assert example_change > CLIP * 1.5


def _rows(x, y, units, k):
    indices, weights = _batch(units, k)
    return x[indices], y[indices], weights


def test_a_user_with_a_non_finite_example_is_dropped_whole_and_the_others_are_untouched():
    model = small_mlp()
    x, y = small_data(8)
    indices, weights = _batch(UNITS)
    clean, _, _ = _unit_statistic(model, "bookkeeping", x[indices], y[indices], weights)
    broken = x.copy()
    broken[6, 0] = np.nan  # the third user's second example
    ours, _, valid = _unit_statistic(model, "bookkeeping", broken[indices], y[indices], weights)
    assert valid.tolist() == [True, True, False, False]
    expected, _, _ = _unit_statistic(model, "bookkeeping", *_rows(x, y, UNITS[:2], K_CAP))
    for a, b, c in zip(ours, expected, clean):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        assert np.all(np.isfinite(a)) and not np.allclose(a, c)


def _zero_input_model():
    """Two classes whose probabilities at a zero input are ``[1, 0]``: class 1's log-likelihood is
    ``-inf`` there, as a loss without probability clipping makes it."""
    inputs = tf.keras.Input((2,))
    hidden = tf.keras.layers.Dense(2, activation="relu", kernel_initializer=tf.constant_initializer(0.5),
                                   bias_initializer=tf.constant_initializer([1.0, 0.0]))(inputs)
    probabilities = tf.keras.layers.Lambda(lambda h: h / tf.reduce_sum(h, axis=-1, keepdims=True))(hidden)
    return tf.keras.Model(inputs, probabilities)


def _unclipped_log_loss(y, p):
    return -tf.math.log(tf.gather(p, tf.cast(tf.reshape(y, [-1]), tf.int32), batch_dims=1))


@pytest.mark.parametrize("engine", ["vectorized", "bookkeeping"])
def test_whether_a_user_counts_depends_on_its_own_examples_only(engine, caplog):
    """Padding rows (zeroed inputs) keep a label: another user's label, infinite loss at a zero input, used
    to drop every user with padding. Here user 0 (examples 0-1) is dropped by its own NaN input whatever
    example 0's label; users 1 and 2 have fewer than k examples, and their step must not depend on it."""
    def weights_after_one_step(label_of_example_0):
        tf.keras.utils.set_random_seed(0)
        model = _zero_input_model()
        dp = sparta_tf.DPModel(model, noise_multiplier=0.0, sample_rate=1.0, clip_norm=1.0, unit="user",
                               examples_per_user=4, physical_batch_size=3, seed=1, engine=engine)
        dp.compile(tf.keras.optimizers.SGD(1.0), loss=_unclipped_log_loss)
        x = np.ones((6, 2), np.float32)
        x[1] = np.nan
        y = np.array([label_of_example_0, 0, 0, 0, 0, 0])
        dp.fit(x, y, users=np.array([0, 0, 1, 1, 1, 2]), epochs=1, steps_per_epoch=1, verbose=0)
        return [w.numpy() for w in model.weights]

    with caplog.at_level(logging.WARNING):
        first, second = weights_after_one_step(0), weights_after_one_step(1)
    assert "1 of 3 sampled users were dropped as non-finite" in caplog.text  # user 0, both times
    assert not np.allclose(first[1], [1.0, 0.0])  # users 1 and 2 trained
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


N_USERS, USER_BATCH, EPOCHS = 16, 4, 2


def _user_data():
    x, y = small_data(60)
    users = np.repeat(np.arange(N_USERS), [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 8, 7])
    return x, y, users


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_the_user_level_ledger_is_dp_sgd_composed_over_users(accountant):
    x, y, users = _user_data()
    dp = sparta_tf.make_private(small_mlp(), method="all", target_epsilon=8.0, delta=1e-3, epochs=EPOCHS,
                                batch_size=USER_BATCH, dataset_size=N_USERS, seed=0, unit="user",
                                examples_per_user=4, accountant=accountant)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    history = dp.fit(x, y, users=users, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    q = USER_BATCH / N_USERS
    steps = EPOCHS * round(1 / q)
    assert dp.ledger.steps == steps and dp.ledger.unit == "user" and dp.dataset_size == N_USERS
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(dp.noise_multiplier)), steps)
    direct = (dp_accounting.pld.PLDAccountant() if accountant == "pld" else dp_accounting.rdp.RdpAccountant())
    direct.compose(event)
    np.testing.assert_allclose(dp.ledger.epsilon(), direct.get_epsilon(1e-3), rtol=1e-3)
    assert "one user" in dp.ledger.report() and dp.ledger.to_json()["unit"] == "user"


def test_sparta_trains_at_user_level_and_its_ledger_is_its_plan(tmp_path):
    x, y, users = _user_data()
    model = small_mlp()
    before = [v.numpy().copy() for v in model.trainable_variables]
    dp = sparta_tf.make_private(model, method="sparta", target_epsilon=8.0, delta=1e-3, epochs=3,
                                batch_size=USER_BATCH, dataset_size=N_USERS, seed=0, unit="user", warmup_epochs=1,
                                mask_dir=str(tmp_path / "mask"))
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS, metrics=["accuracy"])
    dp.fit(x, y, users=users, verbose=0)
    assert list(dp.ledger.entries) == dp.plan.events()
    assert dp.users.examples_per_user == 8  # the default, whatever the users' sizes
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


def test_example_level_is_the_step_without_user_units():
    x, y = small_data(64)
    weights = []
    for unit in (None, "example"):
        options = {} if unit is None else {"unit": unit}
        model = small_mlp()
        dp = sparta_tf.DPModel(model, noise_multiplier=1.0, sample_rate=0.25, delta=1e-3, seed=0, **options)
        dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
        dp.fit(x, y, verbose=0)
        assert dp.users is None and dp.step_parts().users is None and dp.rows_per_unit == 1
        weights.append([v.numpy() for v in model.trainable_variables])
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def _user_model(**options):
    dp = sparta_tf.DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=0.25, delta=1e-3, seed=0, **options)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    return dp


@pytest.mark.parametrize("options, fit_users, message", [
    ({}, "ids", "needs a model with unit='user'"),
    ({"unit": "user"}, None, "needs each example's user"),
    ({"unit": "user"}, "short", "ids for 60 examples"),
    ({"unit": "user"}, "nan", "non-finite ids"),
])
def test_a_users_argument_that_does_not_fit_the_unit_is_refused_before_a_step(options, fit_users, message):
    x, y, users = _user_data()
    given = {"ids": users, "short": users[:10], "nan": np.where(users == 3, np.nan, users.astype(float)),
             None: None}[fit_users]
    dp = _user_model(**options)
    with pytest.raises(ValueError, match=message) as error:
        dp.fit(x, y, users=given, verbose=0)
    assert "\n" not in str(error.value)
    assert dp.ledger.steps == 0 and int(dp.dp_step.numpy()) == 0


@pytest.mark.parametrize("options, message", [
    ({"unit": "person"}, "must be 'example'"),
    ({"examples_per_user": 4}, "needs unit='user'"),
    ({"unit": "user", "examples_per_user": 0}, "must be an integer >= 1"),
    ({"unit": "user", "sampling": "shuffle"}, "Poisson sampling"),
    ({"unit": "user", "bands": 2}, "bands=2"),
])
def test_options_user_level_does_not_cover_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as error:
        dp = _user_model(**options)
        x, y, users = _user_data()
        dp.fit(x, y, users=users, verbose=0)
    assert "\n" not in str(error.value)


def test_a_dataset_is_refused_at_user_level():
    x, y, users = _user_data()
    dp = _user_model(unit="user")
    with pytest.raises(ValueError, match="not a tf.data.Dataset"):
        dp.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), users=users, verbose=0)


@pytest.mark.parametrize("method, options", [("dp_frost", {"gamma": 0.9}), ("dp_ssgd", {"prune": "dp_snip"})])
def test_a_method_with_a_mechanism_before_training_runs_it_over_users(method, options):
    x, y, users = _user_data()
    dp = sparta_tf.make_private(small_mlp(), method=method, target_epsilon=8.0, delta=1e-3, epochs=2,
                                batch_size=USER_BATCH, dataset_size=N_USERS, seed=0, unit="user",
                                examples_per_user=K_CAP, **options)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    dp.fit(x, y, users=users, verbose=0)
    assert list(dp.ledger.entries) == dp.plan.events() and dp.plan.before_training  # the release before training
    assert dp.ledger.unit == "user" and dp.ledger.epsilon() <= 8.0 * (1 + 1e-6)
    assert all(np.isfinite(v.numpy()).all() for v in dp.model.trainable_variables)


def test_a_method_whose_mechanism_before_training_counts_examples_is_refused_at_user_level(monkeypatch):
    from sparta_tf.methods.frost import DpFrost

    monkeypatch.setattr(DpFrost, "users_before_training", False)  # as a method of one's own that does not count users
    with pytest.raises(ValueError, match="unit='user' does not cover") as error:
        sparta_tf.make_private(small_mlp(), method="dp_frost", target_epsilon=8.0, delta=1e-3, epochs=3,
                               batch_size=USER_BATCH, dataset_size=N_USERS, seed=0, unit="user")
    assert "\n" not in str(error.value)


def test_sparta_train_runs_dp_ssgds_dp_snip_at_user_level(tmp_path):
    config = _user_config(tmp_path, examples_per_user=4)
    config["method"] = {"name": "dp_ssgd", "prune": "dp_snip"}
    results = run.train(validate(config))
    assert results["private"] and results["unit"] == "user" and results["epsilon"] <= 8.0 + 1e-6
    ledger = json.loads((tmp_path / "out" / "ledger.json").read_text())
    assert ledger["unit"] == "user" and any(e["kind"] == "dp_snip" for e in ledger["entries"])


# ----------------------------------------------------------------- the mechanisms before training, per user


def _connection_sums(x, y, users, clip, k=K_CAP):
    from sparta_tf.ssgd.pruning import clipped_connection_sums, prunable_variables

    model = _snip_model()
    return clipped_connection_sums(model, x, y, LOSS, prunable_variables(model), clip, users=users,
                                   examples_per_user=None if users is None else k, seed=3)


def _snip_model():
    tf.keras.utils.set_random_seed(0)
    return small_mlp()


@pytest.mark.parametrize("clip", [CLIP, 100.0])  # every user clipped; none (the mean itself)
def test_dp_snip_over_users_is_each_users_mean_connection_gradient_clipped_once(clip):
    from sparta_tf.ssgd.pruning import prunable_variables

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(11, 8)).astype(np.float32), rng.integers(0, 4, 11)
    users = np.array([5, 5, 9, 9, 9, 2, 7, 7, 7, 7, 1])  # 5 users, at most 4 examples: k = 4 takes all
    sums, count = _connection_sums(x, y, users, clip, k=4)
    model = _snip_model()
    prunable = prunable_variables(model)
    reference = [np.zeros(v.shape) for v in prunable]
    for user in np.unique(users):
        per_example = []
        for i in np.nonzero(users == user)[0]:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(PER_EXAMPLE_LOSS(y[i:i + 1], model(x[i:i + 1])))
            per_example.append([g.numpy() * v.numpy() for g, v in zip(tape.gradient(loss, prunable), prunable)])
        mean = [np.mean(parts, axis=0) for parts in zip(*per_example)]
        norm = np.sqrt(sum(np.sum(m**2) for m in mean))
        reference = [r + m * min(1.0, clip / norm) for r, m in zip(reference, mean)]
    assert count == 5
    for got, want in zip(sums, reference):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("size", [1, 5, 50])
def test_one_user_moves_dp_snips_sum_by_at_most_the_clip_norm_whatever_its_size(size):
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(12, 8)).astype(np.float32), rng.integers(0, 4, 12)
    users = np.repeat(np.arange(6), 2)
    extra_x = np.repeat(rng.normal(size=(1, 8)).astype(np.float32), size, axis=0)
    extra_y = np.full(size, 1)
    both_x, both_y = np.concatenate([x, extra_x]), np.concatenate([y, extra_y])
    without, _ = _connection_sums(x, y, users, CLIP)
    with_user, _ = _connection_sums(both_x, both_y, np.concatenate([users, np.full(size, 99)]), CLIP)
    moved = np.sqrt(sum(np.sum((a - b).numpy() ** 2) for a, b in zip(with_user, without)))
    assert moved <= CLIP * (1 + 1e-5)
    if size > 1:  # the same records as examples: each clipped alone, they add up
        examples, _ = _connection_sums(x, y, None, CLIP)
        with_examples, _ = _connection_sums(both_x, both_y, None, CLIP)
        assert np.sqrt(sum(np.sum((a - b).numpy() ** 2) for a, b in zip(with_examples, examples))) > 1.5 * CLIP


def _frost_round(monkeypatch, x, y, users, k=K_CAP):
    """The magnitudes of DP-FROST's first round, noiseless, every unit sampled (q_ps = 1)."""
    from sparta_tf.selection import frost

    observed = {}

    def capture(observe, sizes, *args):
        observed["mu"], observed["sensitivity"] = observe(0, np.arange(len(sizes)))
        return [0], {}

    monkeypatch.setattr(frost, "psel", capture)
    monkeypatch.setattr(frost, "gaussian_noise", lambda shapes, *a, **kw: [tf.zeros(s, tf.float64) for s in shapes])
    tf.keras.utils.set_random_seed(0)
    frost.frost_select(small_mlp(), x, y, LOSS, target_epsilon=8.0, delta=1e-5, sample_rate=0.1, steps=10,
                       gamma=0.9, clip_norm=CLIP, q_ps=1.0, iterations=1, noise_multiplier=1.0, seed=4,
                       users=users, examples_per_user=None if users is None else k)
    return observed["mu"], observed["sensitivity"]


def test_one_user_moves_a_dp_frost_round_as_one_example_does(monkeypatch):
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(12, 8)).astype(np.float32), rng.integers(0, 4, 12)
    users = np.repeat(np.arange(6), 2)
    extra_x = np.repeat(rng.normal(size=(1, 8)).astype(np.float32), 50, axis=0)
    both_x, both_y = np.concatenate([x, extra_x]), np.concatenate([y, np.full(50, 1)])
    mu, sensitivity = _frost_round(monkeypatch, x, y, users)
    mu_user, _ = _frost_round(monkeypatch, both_x, both_y, np.concatenate([users, np.full(50, 99)]))
    assert np.all(np.abs(mu_user - mu) <= sensitivity * (1 + 1e-6))  # each magnitude: one unit's bound
    mu_examples, _ = _frost_round(monkeypatch, x, y, None)
    mu_more, _ = _frost_round(monkeypatch, both_x, both_y, None)
    assert np.max(np.abs(mu_more - mu_examples)) > 1.5 * sensitivity  # 50 examples, each clipped alone


# ----------------------------------------------------------------- sparta-train


def _user_config(tmp_path, export=False, **privacy):
    """The tiny config on an npz of 160 images owned by 40 users of 1-7 examples each."""
    rng = np.random.default_rng(0)
    x = rng.random((160, 8, 8, 3)).astype(np.float32)
    y = np.arange(160) % 3
    users = np.repeat(np.arange(40), [4] * 20 + [1] * 10 + [7] * 10)[:160]
    np.savez(tmp_path / "patients.npz", x_train=x, y_train=y, patient_train=users)
    config = tiny_config(tmp_path / "out", method="sparta", epochs=3, export=export, batch_size=8)
    config["data"] = {"source": "npz", "path": str(tmp_path / "patients.npz"), "user_key": "patient",
                      "class_names": ["a", "b", "c"], "val_fraction": 0.1, "test_fraction": 0.2}
    config["method"]["warmup_epochs"] = 1
    config["privacy"].update(unit="user", **privacy)
    return config


def test_the_dry_run_counts_users_and_says_what_example_level_would_claim_for_a_person(tmp_path, write_config,
                                                                                         capsys):
    assert cli.main(["--config", str(write_config(_user_config(tmp_path))), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "private training users n = " in out and "privacy unit: one user" in out
    assert "examples_per_user k = " in out and "leaving out" in out
    assert "is per user; for comparison, an example-level run at (epsilon 8" in out and "group privacy" in out


def test_sparta_train_trains_at_user_level_and_records_the_unit(tmp_path):
    results = run.train(validate(_user_config(tmp_path, export=True, examples_per_user=4)))
    assert results["private"] and results["epsilon"] <= 8.0 + 1e-6
    assert results["unit"] == "user" and results["examples_per_user"] == 4 and results["plan"]["unit"] == "user"
    ledger = json.loads((tmp_path / "out" / "ledger.json").read_text())
    assert ledger["unit"] == "user" and ledger["entries"]
    assert os.path.isfile(os.path.join(results["export_dir"], "saved_model.pb"))  # the serving export
    data = load_dataset(_user_config(tmp_path)["data"], split_key=0)
    assert results["n"] < len(data.x_train)  # users, not examples


@pytest.mark.parametrize("edit, message", [
    ({"privacy.unit": "example"}, "data.user_key='patient' is given but privacy.unit is example"),
    ({"data.user_key": DELETE}, "privacy.unit: user needs each example's user"),
    ({"privacy.bands": 2}, "privacy.bands=2"),
    ({"privacy.sampling": "shuffle"}, "privacy.sampling='shuffle'"),
])
def test_a_config_user_level_does_not_cover_is_refused_in_one_line(tmp_path, edit, message):
    config = _user_config(tmp_path)
    for key, value in edit.items():
        set_key(config, key, value)
    with pytest.raises(ConfigError, match=message) as error:
        validate(config)
    assert "\n" not in str(error.value)


# ----------------------------------------------------------------- private tuning


def test_the_tuning_score_counts_users_so_one_user_moves_it_by_at_most_one():
    model = small_mlp()
    x, y = small_data(80)
    users = np.repeat(np.arange(20), 4)
    right = np.argmax(model.predict(x, verbose=0), axis=-1) == y
    newcomer_x, newcomer_y = np.repeat(x[right][:1], 50, axis=0), np.repeat(y[right][:1], 50)  # 50 right answers
    grown = np.concatenate([x, newcomer_x]), np.concatenate([y, newcomer_y]), np.append(users, [99] * 50)
    by_example = procedure.count_correct(model, *grown[:2]), procedure.count_correct(model, x, y)
    assert by_example[0] - by_example[1] == 50  # at example level one person moves the count by 50
    at_user_level = (procedure.count_correct(model, *grown[:2], users=grown[2]),
                     procedure.count_correct(model, x, y, users=users))
    assert at_user_level[0] - at_user_level[1] == pytest.approx(1.0)
    expected = sum(np.mean(right[users == u]) for u in range(20))
    assert at_user_level[1] == pytest.approx(expected)
    assert procedure.validation_units(y, users) == 20 and procedure.validation_units(y) == 80


def test_tune_privately_at_user_level_samples_users_and_scores_users():
    x, y, users = _user_data()
    x_val, y_val = small_data(30)
    validation_users = np.repeat(np.arange(10), 3)
    result = sparta_tf.tune_privately(
        small_mlp, x, y, validation_data=(x_val, y_val), space={"learning_rate": [0.1, 0.5]}, target_epsilon=8.0,
        delta=1e-3, epochs=2, batch_size=USER_BATCH, method="all", mean=1.5, tuning_seed=0, unit="user",
        examples_per_user=4, users=users, validation_users=validation_users)
    plan = result.model.plan
    assert plan.unit == "user" and plan.n == N_USERS and result.model.users.examples_per_user == 4
    assert result.ledger.unit == "user" and result.model.ledger is result.ledger  # the release protects users
    assert result.ledger.to_json()["unit"] == "user"
    tally = procedure.Tally([], "example")
    with pytest.raises(ValueError, match="protects one user but the tuning's plan one example"):
        tally.add(0.5, result.ledger)
    planned = [e for e in result.ledger.entries if e.kind != "tuning_score"]
    score_noise = procedure.default_score_noise(10)  # sqrt(validation users) / 2
    assert result.epsilon == pytest.approx(tuning_epsilon(per_run_event(planned, score_noise), result.ledger.tuning,
                                                          1e-3), rel=1e-9)
    with pytest.raises(ValueError, match="needs users= .* and validation_users="):
        sparta_tf.tune_privately(small_mlp, x, y, validation_data=(x_val, y_val), space={"learning_rate": [0.1]},
                                 target_epsilon=8.0, delta=1e-3, epochs=2, batch_size=USER_BATCH, unit="user",
                                 users=users)


def test_sparta_tune_dry_run_scores_validation_users(tmp_path, write_config, capsys):
    config = _user_config(tmp_path)
    config["tuning"] = {"space": {"training.learning_rate": [0.03, 0.1]}, "mean": 2, "seed": 0}
    assert tune_cli.main(["--config", str(write_config(config)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "validation users (each its share of examples right)" in out


# ----------------------------------------------------------------- kill -9 and resume

_KILLED_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    import sparta_tf

    run_dir, kill_at, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    kill = tf.keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: (
        os.kill(os.getpid(), signal.SIGKILL) if int(dp.dp_step.numpy()) == kill_at else None))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(90, 8)).astype(np.float32), rng.integers(0, 4, 90)
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(4, name="head")])
    users = np.repeat(np.arange(30), rng.integers(1, 6, 30))[:90]
    users = np.concatenate([users, np.full(90 - len(users), 30)])
    # a budget with room for the steps a resumed run repeats (each is charged again)
    dp = sparta_tf.make_private(model, method="sparta", target_epsilon=50.0, noise_multiplier=1.0, delta=1e-3,
                                epochs=4, batch_size=8, dataset_size=len(np.unique(users)), warmup_epochs=1, density=0.5, run_dir=run_dir,
                                seed=7, unit="user", examples_per_user=3)
    dp.compile(tf.keras.optimizers.SGD(0.1, momentum=0.9),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dp.fit(x, y, users=users, verbose=0, callbacks=[kill])
    np.savez(out, *[v.numpy() for v in model.weights], steps=dp.ledger.steps)
""")


def test_a_user_level_run_killed_and_resumed_ends_as_an_uninterrupted_one(tmp_path):
    kill_at = 13  # 4 steps an epoch: in the sparse phase, after the selection epoch's checkpoint
    script = tmp_path / "train.py"
    script.write_text(_KILLED_SCRIPT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")

    def run_script(run_dir, kill, out):
        return subprocess.run([sys.executable, str(script), str(run_dir), str(kill), str(out)], capture_output=True,
                              text=True, env=env, timeout=600)

    whole = run_script(tmp_path / "whole", -1, tmp_path / "whole.npz")
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = run_script(tmp_path / "run", kill_at, tmp_path / "unused.npz")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_script(tmp_path / "run", -1, tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected, got = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    assert int(got["steps"]) >= int(expected["steps"])  # the steps run twice are charged twice
    for key in expected.files:
        if key != "steps":
            np.testing.assert_array_equal(got[key], expected[key])


def test_the_audit_refuses_a_user_level_config_in_one_line(tmp_path, write_config, capsys):
    assert audit.main(["--config", str(write_config(_user_config(tmp_path)))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "data canaries are single examples" in lines[0] and "--white-box" in lines[0]


@pytest.mark.parametrize("setting", ["micro-batches", "jit", "two-replicas"])
def test_micro_batches_xla_and_two_replicas_train_as_one_batch_on_one_replica(setting):
    """The same users and sample: one micro-batch of every sampled user on one replica, against micro-batches
    of 2 users, an XLA-compiled step, or two replicas (each half of every micro-batch). The noise is kept
    tiny: XLA draws the noise stream's values its own way."""
    x, y, users = _user_data()
    weights = []
    for name in ("reference", setting):
        strategy = two_cpu_replicas() if name == "two-replicas" else tf.distribute.get_strategy()
        with strategy.scope():
            tf.keras.utils.set_random_seed(0)
            dp = sparta_tf.DPModel(small_mlp(), noise_multiplier=1e-7, sample_rate=USER_BATCH / N_USERS,
                                   seed=0, unit="user", examples_per_user=4,  # no delta: nothing to account
                                   physical_batch_size={"reference": 16, "micro-batches": 2}.get(name, 16),
                                   jit_compile=name == "jit")
            dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
        dp.fit(x, y, users=users, epochs=1, verbose=0)
        weights.append([v.numpy() for v in dp.model.trainable_variables])
    for one, other in zip(*weights):
        np.testing.assert_allclose(one, other, rtol=1e-4, atol=1e-5)


def test_the_white_box_audit_of_a_user_level_run_draws_canary_users_and_stays_below_its_claim():
    x, y, users = _user_data()
    dp = sparta_tf.make_private(small_mlp(), method="all", target_epsilon=4.0, delta=1e-3, epochs=3,
                                batch_size=USER_BATCH, dataset_size=N_USERS, seed=0, unit="user", examples_per_user=4)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    report = audit_white_box(dp, x, y, users=users, canaries=40, verbose=0)
    assert report.observed_steps == dp.ledger.steps and report.mismatches == [] and not report.contradicts_claim
    assert report.checks["sample_rate"].claimed == pytest.approx(USER_BATCH / N_USERS)  # users at the user rate


def test_a_ledger_of_the_other_unit_is_refused_before_a_step():
    """A ledger restored from a run at the other unit would claim its epsilon for one user while the steps
    sample examples (or the reverse): refused in one line, nothing charged."""
    x, y = small_data(32)
    users = np.arange(32) // 2
    dp = sparta_tf.DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=0.25, delta=1e-3, seed=0, unit="user",
                           examples_per_user=2)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    dp.ledger = sparta_tf.PrivacyLedger(1e-3)  # example level
    with pytest.raises(ValueError, match=r"^the ledger protects one example but this model's DP steps protect one user"):
        dp.fit(x, y, users=users, verbose=0)
    assert int(dp.dp_step.numpy()) == 0 and dp.ledger.steps == 0
