"""Layers that mix the examples of a batch are refused: by class and by a behaviour probe."""

import functools

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf import DPModel, NotPerExampleSafeError
from sparta_tf.model_checks import is_batch_normalization, probe_batch_mixing
from small_models import LOSS, gaussian_data


def _with(layer, dropout=False):
    inputs = tf.keras.Input((6,))
    x = tf.keras.layers.Dense(8)(inputs)
    x = layer(x)
    if dropout:
        x = tf.keras.layers.Dropout(0.5)(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(3, name="head")(x))


_data = functools.partial(gaussian_data, 16, (6,), 3)  # 16 examples for _with's 6 inputs and 3 classes


class BatchCentering(tf.keras.layers.Layer):
    """Subtracts the batch mean without a gradient through it: mixes examples invisibly to autodiff."""

    def call(self, x, training=None):
        return x - tf.stop_gradient(tf.reduce_mean(x, axis=0)) if training else x


class RunningMean(tf.keras.layers.Layer):
    """Per-example output, but writes a running mean of the data into its state."""

    def build(self, shape):
        self.mean = self.add_weight(name="mean", shape=shape[-1:], initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, axis=0))
        return x


def _sync_batch_normalization():
    """Keras 2's ``layers.experimental.SyncBatchNormalization``; Keras 3 has no class of its own for it,
    only ``BatchNormalization(synchronized=True)``."""
    experimental = getattr(tf.keras.layers, "experimental", None)
    if experimental is not None and hasattr(experimental, "SyncBatchNormalization"):
        return experimental.SyncBatchNormalization()
    return tf.keras.layers.BatchNormalization(synchronized=True)


@pytest.mark.parametrize("make", [
    tf.keras.layers.BatchNormalization,
    _sync_batch_normalization,
    tf.compat.v1.keras.layers.BatchNormalization,
], ids=["keras", "sync", "compat_v1"])
def test_every_batchnorm_variant_is_refused(make):
    """Regression: SyncBatchNormalization and the compat.v1 class derive from the shared base class,
    not from BatchNormalization, and got past an isinstance check."""
    layer = make()
    assert is_batch_normalization(layer)
    with pytest.raises(NotPerExampleSafeError, match="BatchNormalization in training mode"):
        DPModel(_with(layer), noise_multiplier=1.0, sample_rate=0.25)
    frozen = make()
    frozen.trainable = False
    DPModel(_with(frozen), noise_multiplier=1.0, sample_rate=0.25)  # inference mode: allowed


@pytest.mark.parametrize("layer, problem", [
    (BatchCentering(), "changes when another example"),
    (RunningMean(), "changes the non-trainable variables"),
])
def test_the_probe_refuses_layers_that_mix_examples_before_the_first_step(layer, problem):
    model = _with(layer)
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.25, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    before = [v.numpy() for v in model.variables]
    x, y = _data()
    with pytest.raises(NotPerExampleSafeError, match=problem):
        dp.fit(x, y, epochs=1, verbose=0)
    for variable, value in zip(model.variables, before):  # the probe leaves the model as it was
        np.testing.assert_array_equal(variable.numpy(), value)
    assert int(dp.dp_step.numpy()) == 0


@pytest.mark.parametrize("layer", [tf.keras.layers.LayerNormalization(), tf.keras.layers.GroupNormalization(2)])
def test_per_example_layers_pass_the_probe_with_dropout(layer):
    model = _with(layer, dropout=True)
    x, _ = _data()
    assert probe_batch_mixing(model, x) is True
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.25, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    dp.fit(*_data(), epochs=1, verbose=0)
    assert int(dp.dp_step.numpy()) == 4


def test_the_probe_checks_datasets_too():
    model = _with(BatchCentering())
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.25, dataset_size=16, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, np.ones(16, np.float32))).batch(4)
    with pytest.raises(NotPerExampleSafeError):
        dp.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)


def test_sample_weights_other_than_zero_or_one_are_refused():
    dp = DPModel(_with(tf.keras.layers.LayerNormalization()), noise_multiplier=1.0, sample_rate=0.25,
                 dataset_size=16, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    x, y = _data()
    weights = np.full(16, 2.0, np.float32)  # would scale every clipped contribution by 2
    dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(4)
    with pytest.raises(ValueError, match="sample weights include 2: .*0/1 padding mask"):  # before the first step
        dp.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
    assert int(dp.dp_step.numpy()) == 0
    later = np.where(np.arange(16) < 4, 1.0, 2.0).astype(np.float32)  # the first batch passes, the second not
    dataset = tf.data.Dataset.from_tensor_slices((x, y, later)).batch(4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="0/1 padding mask"):
        dp.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
    padding = tf.data.Dataset.from_tensor_slices((x, y, (np.arange(16) % 2).astype(np.float32))).batch(4)
    dp.fit(padding, epochs=1, steps_per_epoch=2, verbose=0)


def test_a_model_with_a_layer_adapted_to_data_gets_a_ledger_caveat():
    """``Normalization.adapt(x_train)`` writes the private data's mean and variance into the model that is
    released: the guarantee assumes the starting model is public, so the ledger says so. On Keras 2 a layer
    given its statistics is not adapted; Keras 3 does not tell the two apart, so both get the caveat."""
    from sparta_tf.backend import KERAS3

    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")

    def dp_of(normalization):
        model = tf.keras.Sequential([tf.keras.Input((4,)), normalization, tf.keras.layers.Dense(2)])
        return DPModel(model, noise_multiplier=1.0, sample_rate=0.25, dataset_size=32, delta=1e-5, seed=0)

    adapted = tf.keras.layers.Normalization(name="norm")
    adapted.adapt(x)
    caveats = dp_of(adapted).ledger.caveats()
    assert any("preprocessing layers ['norm']" in c and "adapt()" in c for c in caveats), caveats
    given = dp_of(tf.keras.layers.Normalization(mean=[0.0] * 4, variance=[1.0] * 4, name="given"))
    assert any("['given']" in c for c in given.ledger.caveats()) == KERAS3
    plain = dp_of(tf.keras.layers.Rescaling(0.5))
    assert not plain.ledger.caveats()
