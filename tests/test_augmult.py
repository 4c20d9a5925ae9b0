"""Augmentation multiplicity through ``make_private``, ``fit`` and ``sparta-train``.

* the ledger does not depend on ``K``: the same events with ``K = 1`` and ``K = 4``;
* one method of each kind trains with ``K = 2``, and its ledger records exactly the plan's events;
* ``K = 1`` without an augmentation is today's step (no views at all);
* the views come from the run's ``augmult`` stream: the same for the same step, micro-batch and
  replica, different otherwise; the default view is a flip and a shift of its own image;
* bad options and an augmentation that cannot take the inputs are refused in one line before
  the first step, with nothing charged;
* ``sparta-train --dry-run`` says what a micro-batch runs;
* under ``tf.distribute``, identical views on two replicas train exactly as one view on one.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf.data.view_augmentation import FlipAndCrop, view_augmentation
from sparta_tf.dp_step.views import AugmentationMultiplicity
from small_configs import ONE_METHOD_OF_EACH_KIND, tiny_config
from small_models import LOSS, conv_gn_model, gaussian_data, small_data, small_mlp
from trainers import cli, run
from trainers.config import validate
from two_replicas import two_cpu_replicas

N, BATCH, EPOCHS = 64, 16, 3
OPTIONS = {"sparta": {"warmup_epochs": 1}, "dpsgd_grad": {"warmup_epochs": 1}, "oracle": {"warmup_epochs": 1},
           "x_bitfit": {"full_epochs": 1}}


def jitter(example, seed):
    """One view of a vector example: plus Gaussian noise of std 0.1."""
    return example + 0.1 * tf.random.stateless_normal(tf.shape(example), seed)


def _private(method: str, model, augmult: int, **kwargs):
    options = dict(OPTIONS.get(method, {}), **kwargs)
    dp = sparta_tf.make_private(model, method=method, target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                batch_size=BATCH, dataset_size=N, seed=0, augmult=augmult, **options)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS, metrics=["accuracy"])
    return dp


def test_the_ledger_does_not_depend_on_the_number_of_views():
    x, y = gaussian_data(N, (6, 6, 2), 3)
    ledgers = []
    for augmult in (1, 4):
        dp = _private("all", conv_gn_model(), augmult, physical_batch_size=8)
        dp.fit(x, y, verbose=0)
        ledgers.append(dp.ledger)
    assert ledgers[0].entries == ledgers[1].entries
    assert ledgers[0].epsilon() == ledgers[1].epsilon()


@pytest.mark.parametrize("method", ONE_METHOD_OF_EACH_KIND)
def test_each_kind_of_method_trains_with_views_and_charges_its_plan(method, tmp_path):
    model = small_mlp()
    before = [v.numpy().copy() for v in model.trainable_variables]
    dp = _private(method, model, 2, augmentation=jitter, mask_dir=str(tmp_path / "mask"))
    x, y = small_data(N)
    history = dp.fit(x, y, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert list(dp.ledger.entries) == dp.plan.events()
    moved = [not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables)]
    assert any(moved), f"{method}: no weight trained"


def test_one_view_without_an_augmentation_is_the_plain_step():
    dp = sparta_tf.DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=0.25, augmult=1)
    assert dp.views is None and dp.augmult == 1
    assert sparta_tf.DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=0.25, augmult=3).augmult == 3


def test_views_differ_by_step_micro_batch_and_replica_and_repeat_for_the_same_ones():
    views = AugmentationMultiplicity(2, None, seed=5)
    images = tf.random.stateless_normal([4, 8, 8, 3], [1, 2])
    valid = tf.ones([4], tf.bool)

    def drawn(step, micro_batch):
        return views.expand(images, tf.zeros([4]), valid, views.key(step, micro_batch))[0].numpy()

    np.testing.assert_array_equal(drawn(3, 0), drawn(3, 0))
    assert not np.array_equal(drawn(3, 0), drawn(4, 0))
    assert not np.array_equal(drawn(3, 0), drawn(3, 1))
    other_seed = AugmentationMultiplicity(2, None, seed=6)
    assert not np.array_equal(views.key(3, 0).numpy(), other_seed.key(3, 0).numpy())


def test_a_default_view_is_a_flip_and_shift_of_its_own_image():
    images = np.random.RandomState(0).rand(6, 7, 9, 2).astype(np.float32)
    pad = 2
    views = FlipAndCrop(flip=True, pad=pad)(tf.constant(images), tf.constant([4, 2], tf.int64)).numpy()
    assert views.shape == images.shape
    for image, view in zip(images, views):
        candidates = []
        for flipped in (image, image[:, ::-1]):
            padded = np.pad(flipped, [(pad, pad), (pad, pad), (0, 0)], mode="reflect")
            candidates += [padded[dy : dy + 7, dx : dx + 9] for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)]
        assert any(np.array_equal(view, c) for c in candidates)
    assert len({v.tobytes() for v in views}) > 1


def test_padding_and_non_finite_examples_are_zeroed_before_the_augmentation_and_dropped():
    views = AugmentationMultiplicity(3, None, seed=0)
    images = np.ones([3, 8, 8, 1], np.float32)
    images[1, 0, 0, 0] = np.nan
    rows, labels, usable = views.expand(tf.constant(images), tf.constant([0, 1, 2]), tf.constant([True, True, False]),
                                        tf.constant([0, 1], tf.int64))
    assert rows.shape == (9, 8, 8, 1) and labels.numpy().tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert usable.numpy().tolist() == [True, False, False]
    assert np.all(rows.numpy()[3:] == 0)


@pytest.mark.parametrize("augmult", [0, 2.5, True, "4"])
def test_a_bad_number_of_views_is_refused_in_one_line(augmult):
    with pytest.raises(ValueError, match="augmult=.* must be an integer >= 1") as error:
        sparta_tf.DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=0.25, augmult=augmult)
    assert "\n" not in str(error.value)


def test_the_default_augmentation_on_vectors_is_refused_before_the_first_step():
    dp = _private("all", small_mlp(), 2)
    x, y = small_data(N)
    with pytest.raises(ValueError, match="needs images .* pass augmentation=") as error:
        dp.fit(x, y, verbose=0)
    assert "\n" not in str(error.value)
    assert dp.ledger.steps == 0 and int(dp.dp_step.numpy()) == 0


def test_an_augmentation_that_changes_the_shape_is_refused_before_the_first_step():
    dp = _private("all", small_mlp(), 2, augmentation=lambda x, seed: x[:4])
    x, y = small_data(N)
    with pytest.raises(ValueError, match="changed the inputs from"):
        dp.fit(x, y, verbose=0)
    assert dp.ledger.steps == 0


def test_a_keras_preprocessing_layer_draws_the_views():
    layer = tf.keras.layers.RandomTranslation(0.2, 0.2, fill_mode="reflect", seed=1)
    dp = _private("all", conv_gn_model(), 2, augmentation=layer)
    x, y = gaussian_data(N, (6, 6, 2), 3)
    assert np.isfinite(dp.fit(x, y, verbose=0).history["loss"]).all()


class _BatchStandardising(tf.keras.layers.Layer):
    """Mixes the rows of a batch: each row minus the batch's mean."""

    def call(self, x, training=None):
        return x - tf.reduce_mean(x, axis=0, keepdims=True) + 1.0


def test_a_keras_layer_augmentation_sees_one_example_at_a_time():
    """A layer that standardises by the batch would let example 0 move every other example's views."""
    views = view_augmentation(_BatchStandardising())
    x = np.random.default_rng(5).normal(size=(4, 3)).astype(np.float32)
    other = x.copy()
    other[0] += 100.0
    np.testing.assert_array_equal(views(x, None).numpy()[1:], views(other, None).numpy()[1:])
    assert np.all(views(x, None).numpy() == 1.0)  # each row is its own batch


class _RunningMean(tf.keras.layers.Layer):
    def build(self, input_shape):
        self.mean = self.add_weight(name="running_mean", shape=input_shape[1:], initializer="zeros",
                                    trainable=False)

    def call(self, x, training=None):
        self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, axis=0))
        return x - self.mean


def test_a_keras_layer_augmentation_that_writes_a_statistic_is_refused_before_the_first_step():
    dp = _private("all", small_mlp(), 2, augmentation=_RunningMean())
    x, y = small_data(N)
    with pytest.raises(ValueError, match=r"writes the variables .*running_mean[^\n]*$"):
        dp.fit(x, y, verbose=0)
    assert dp.ledger.steps == 0


def test_the_dry_run_says_what_a_micro_batch_runs(tmp_path, write_config, capsys):
    config = tiny_config(tmp_path / "out", method="all", epochs=2, augmult=4, physical_batch_size=16)
    assert cli.main(["--config", str(write_config(config)), "--dry-run"]) == 0  # sparta-train, in this process
    out = capsys.readouterr().out
    assert "4 views per example" in out and "16 examples x 4 views = 64 rows" in out


def test_sparta_train_runs_with_views(tmp_path, capsys):
    config = tiny_config(tmp_path / "out", method="sparta", epochs=3, augmult=2, augmult_pad=1)
    config["method"]["warmup_epochs"] = 1
    results = run.train(validate(config))  # in this process: the traced functions it shares with the others
    assert results["private"] and results["epsilon"] <= 8.0 + 1e-6
    out = capsys.readouterr().out
    assert "augmentation multiplicity: 2 views per example" in out and "test accuracy" in out
    assert json.loads((tmp_path / "out" / "ledger.json").read_text())["entries"]


def test_a_jit_compiled_step_with_micro_batches_trains_with_views():
    x, y = gaussian_data(N, (6, 6, 2), 3)
    model = conv_gn_model()
    before = [v.numpy().copy() for v in model.trainable_variables]
    dp = sparta_tf.DPModel(model, noise_multiplier=1.0, sample_rate=BATCH / N, delta=1e-5, seed=0, augmult=3,
                           augmentation={"flip": True, "pad": 1}, physical_batch_size=8, jit_compile=True)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS, metrics=["accuracy"])
    history = dp.fit(x, y, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
    assert dp.ledger.steps == round(N / BATCH)


def test_identical_views_on_two_replicas_train_as_one_view_on_one():
    """K copies of each example (an identity augmentation) average to the example's own gradient: two
    replicas with K = 2 move the weights as one replica with K = 1 (same sample, same noise)."""
    two_replicas = two_cpu_replicas()
    x, y = small_data(N)
    weights = []
    for strategy, augmult in ((tf.distribute.get_strategy(), 1),
                              (two_replicas, 2)):
        with strategy.scope():
            tf.keras.utils.set_random_seed(0)
            dp = sparta_tf.DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=BATCH / N, delta=1e-5, seed=0,
                                   physical_batch_size=32, augmult=augmult,
                                   augmentation=(lambda x, seed: x) if augmult > 1 else None)
            dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
        dp.fit(x, y, epochs=1, verbose=0)
        weights.append([v.numpy() for v in dp.model.trainable_variables])
    for one, two in zip(*weights):
        np.testing.assert_allclose(one, two, rtol=1e-5, atol=1e-6)
