"""AutoGraph leaves the library's code unconverted (:mod:`sparta_tf.autograph_rule`) and still converts the
user's: a subclassed model whose ``call`` branches on a tensor trains under the DP step as under Keras."""

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.dp_model import DPModel
from sparta_tf.per_example.bookkeeping import clipped_batch
from small_models import LOSS, gaussian_data

L = tf.keras.layers


class BranchesOnATensor(tf.keras.Model):
    """``if`` on a tensor in ``call``: in a graph only AutoGraph's rewrite (a ``tf.cond``) can run it."""

    def __init__(self):
        super().__init__()
        self.hidden = L.Dense(4)
        self.head = L.Dense(3)

    def call(self, x):
        h = self.hidden(x)
        if tf.reduce_sum(tf.shape(h)) > 0:  # a tensor inside a tf.function
            h = tf.nn.relu(h)
        return self.head(h)


def _model(seed=0):
    tf.keras.utils.set_random_seed(seed)
    model = BranchesOnATensor()
    model(np.zeros((1, 5), np.float32))  # built eagerly (Keras's own build traces call without AutoGraph)
    return model


def _weights(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def test_the_library_is_exempt_from_autograph():
    from tensorflow.python.autograph.impl import conversion  # the private check AutoGraph itself runs

    assert conversion.is_allowlisted(clipped_batch) and conversion.is_allowlisted(DPModel.train_step)
    assert not conversion.is_allowlisted(BranchesOnATensor.call)  # the user's code is converted


def test_a_call_that_needs_autograph_takes_the_same_traced_step_under_dp_fit_as_under_keras_fit():
    """No noise, no clipping, every example in the one batch: DPModel.fit's traced step is Keras's mean-gradient
    step on the same model."""
    x, y = gaussian_data(16, (5,), 3, 0)
    y = y.astype("int32")
    keras_model = _model()
    keras_model.compile(tf.keras.optimizers.SGD(0.3), loss=LOSS)
    try:
        keras_model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    except tf.errors.OperatorNotAllowedInGraphError:  # Keras 3 runs a layer's call as written
        pytest.skip("this Keras does not convert a layer's call with AutoGraph: its own fit refuses the model")

    model = _model()
    dp = DPModel(model, noise_multiplier=0.0, clip_norm=1e9, sample_rate=1.0, dataset_size=16, seed=1)
    dp.compile(tf.keras.optimizers.SGD(0.3), loss=LOSS)
    dp.fit(tf.data.Dataset.from_tensors((x, y, np.ones(16, np.float32))), epochs=1, steps_per_epoch=1, verbose=0)
    for ours, theirs in zip(_weights(model), _weights(keras_model)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
