"""Sampled examples a DP step cannot use (a NaN or infinite input, view or gradient norm).

* a step counts them (the ``non_finite`` metric): with and without augmentation views, on two replicas, with
  micro-batches, with the materialising engine, and padding rows are not counted;
* validation logs have no such count (it is the DP step's);
* an epoch whose sampled examples were all dropped logs an error but never stops ``fit`` (a stop would be
  a noiseless count of the private data);
* an augmentation that turns finite inputs into NaN views is refused before anything is charged;
* ``sparta-train`` writes the count to ``results.json`` (``test_cli_run``).
"""

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf.callbacks import NonFiniteTrainingError
from small_models import LOSS, small_mlp

NAN_ROWS = (1, 4, 6)


def _dp_model(**options):
    dp = sparta_tf.DPModel(small_mlp(), clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, dataset_size=16,
                           seed=0, **options)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS, metrics=["accuracy"])
    return dp


def _batch_with_nan_rows():
    x = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    x[list(NAN_ROWS), 2] = np.nan
    weights = np.ones(8, np.float32)
    weights[7] = 0.0  # a padding row: neither sampled nor dropped
    return x, np.arange(8) % 3, weights


def jitter(example, seed):
    return example + 0.1 * tf.random.stateless_normal(tf.shape(example), seed)


@pytest.mark.parametrize("options", [{}, {"augmult": 2, "augmentation": jitter}, {"physical_batch_size": 4},
                                     {"engine": "layerwise"}],
                         ids=["plain", "views", "micro_batches", "materialising"])
def test_a_step_counts_the_sampled_examples_it_dropped(options):
    dp = _dp_model(**options)
    x, y, weights = _batch_with_nan_rows()
    logs = dp.train_on_batch(x, y, sample_weight=weights, return_dict=True)
    assert logs["non_finite"] == len(NAN_ROWS)
    assert dp.metrics[-1].counts() == (len(NAN_ROWS), 7)
    assert all(np.all(np.isfinite(v.numpy())) for v in dp.model.trainable_variables)
    logs = dp.train_on_batch(x[:4], y[:4], sample_weight=np.ones(4, np.float32), return_dict=True)
    assert logs["non_finite"] == 1  # train_on_batch resets the metrics: row 1 only


def test_a_non_finite_gradient_of_a_finite_input_is_counted():
    dp = _dp_model()
    x = np.ones((4, 8), np.float32)
    x[2] = 3e38  # finite, but its activations and gradient overflow
    logs = dp.train_on_batch(x, np.zeros(4, np.int64), sample_weight=np.ones(4, np.float32), return_dict=True)
    assert logs["non_finite"] == 1


def test_validation_logs_have_no_count_and_the_epoch_shows_it(capsys):
    x = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)
    x[3] = np.nan
    y = np.arange(16) % 3
    dp = _dp_model()
    history = dp.fit(x, y, epochs=2, validation_data=(x[4:], y[4:]), verbose=2)
    assert "non_finite" in history.history and "val_non_finite" not in history.history
    assert all(count in (0.0, 1.0, 2.0) for count in history.history["non_finite"])  # row 3, sampled in 0-2 steps
    assert "non_finite:" in capsys.readouterr().out


def test_an_epoch_whose_examples_were_all_dropped_is_logged_and_fit_runs_on(caplog):
    """Whether a model comes out must not read the count: one finite example more (sampled or not) leaves
    the steps run, and the weights' finiteness, as they are."""
    x = np.full((16, 8), np.nan, np.float32)
    y = np.arange(16) % 3
    all_dropped = _dp_model()
    with caplog.at_level("ERROR", logger="sparta_tf.dp_step.usable_examples"):
        all_dropped.fit(x, y, epochs=3, verbose=0)
    learnt_nothing = [r for r in caplog.records if "learnt nothing" in r.getMessage()]
    assert len(learnt_nothing) >= 2 and all(r.levelname == "ERROR" for r in learnt_nothing)  # epochs that sampled
    x_one_finite = x.copy()
    x_one_finite[5] = 1.0
    one_finite = _dp_model()
    one_finite.fit(x_one_finite, y, epochs=3, verbose=0)
    assert all_dropped.dp_step.numpy() == one_finite.dp_step.numpy() == 6  # 16 examples, q = 0.5: 2 steps an epoch
    for model in (all_dropped, one_finite):
        assert all(np.all(np.isfinite(v.numpy())) for v in model.model.trainable_variables)


def nan_views(example, seed):
    return example * np.nan


def test_an_augmentation_with_non_finite_views_is_refused_before_anything_is_charged():
    x, y = np.random.default_rng(2).normal(size=(32, 8)).astype(np.float32), np.arange(32) % 3
    dp = sparta_tf.make_private(small_mlp(), method="all", target_epsilon=8.0, delta=1e-5, epochs=1, batch_size=8,
                                dataset_size=32, seed=0, augmult=2, augmentation=nan_views)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    with pytest.raises(ValueError, match=r"^augmentation .* returned NaN or infinite views of finite inputs[^\n]*$"):
        dp.fit(x, y, verbose=0)
    assert dp.ledger.steps == 0


def test_two_replicas_count_the_examples_of_both():
    """The same seed samples the same batches on one replica and on two (tests/test_augmult.py)."""
    from two_replicas import two_cpu_replicas

    x = np.random.default_rng(3).normal(size=(64, 8)).astype(np.float32)
    x[::5, 0] = np.nan
    y, counts = np.arange(64) % 3, []
    for strategy in (tf.distribute.get_strategy(), two_cpu_replicas()):
        with strategy.scope():
            dp = sparta_tf.DPModel(small_mlp(), clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.25, seed=0,
                                   physical_batch_size=32)
            dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
        history = dp.fit(x, y, epochs=1, verbose=0)
        counts.append((history.history["non_finite"][0], dp.metrics[-1].counts()))
    assert counts[0] == counts[1] and counts[0][0] > 0


def test_the_divergence_guard_reads_the_weights_not_a_loss_one_dropped_example_made_non_finite():
    """An example whose finite input overflows the activations is dropped by the step (it contributes nothing),
    but its loss makes the logged batch loss NaN: stopping on that would let one example decide whether the run
    releases anything. The guard stops on non-finite weights only."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 8)).astype("float32"), rng.integers(0, 3, 200)
    x[7] = 3e38
    tf.keras.utils.set_random_seed(1)
    inputs = tf.keras.Input((8,))
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(3)(tf.keras.layers.Dense(6, activation="relu")(inputs)))
    dp = sparta_tf.DPModel(model, noise_multiplier=1.0, sample_rate=0.1, delta=1e-3, seed=5, engine="vectorized")
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = dp.fit(x, y, epochs=1, verbose=0, callbacks=[sparta_tf.NonFiniteGuard()])
    assert not all(np.isfinite(history.history["loss"]))  # the example's loss reached the log
    assert int(dp.dp_step.numpy()) == 10 and all(np.isfinite(w).all() for w in model.get_weights())


def test_the_divergence_guard_stops_fit_once_the_weights_overflow():
    x, y = np.random.default_rng(4).normal(size=(16, 8)).astype(np.float32), np.arange(16) % 3
    dp = sparta_tf.DPModel(small_mlp(), clip_norm=1.0, noise_multiplier=1e3, sample_rate=0.5, dataset_size=16, seed=0)
    dp.compile(tf.keras.optimizers.SGD(3e38), loss=LOSS)  # noise ~ 1e2 a coordinate: the first step overflows
    with pytest.raises(NonFiniteTrainingError, match=r"training diverged; lower the learning rate"):
        dp.fit(x, y, epochs=3, verbose=0, callbacks=[sparta_tf.NonFiniteGuard()])
    assert dp.dp_step.numpy() <= 2  # stopped in its first epoch
