"""Augmentation multiplicity on every layer a user writes: each example's K views are one example.

For each model of :mod:`layer_zoo` under ``engine="auto"`` (jit off; on too for one model of each
family, :data:`XLA_CASES`), and for those family models under a materialising engine on Keras 2 (jit off),
with the views drawn inside the traced step (:class:`~sparta_tf.dp_step.views.AugmentationMultiplicity`):

* the clipped sum equals the K-view one-example reference: every view's gradient taken alone with
  ``tf.GradientTape`` (float64), averaged over the example's views, clipped once, summed;
* padding rows (NaN-filled) contribute exactly zero, and changing the other rows of the batch
  leaves one example's contribution bit-identical;
* one example's contribution has norm at most ``C``.
"""

import numpy as np
import pytest
import tensorflow as tf

from layer_zoo import (
    CASES,
    assert_matches_reference,
    assert_one_example_is_isolated_and_bounded,
    flat,
    loss_fn,
    norms,
    reference_clipped_sum,
)
from sparta_tf.backend import KERAS3
from sparta_tf.dp_step.views import AugmentationMultiplicity
from sparta_tf.per_example import make_engine
from sparta_tf.per_example.bookkeeping import clipped_batch

VIEWS = 2
FLOAT_TOLERANCE = 1e-5
LOW_PRECISION_TOLERANCE = 3e-2
MATERIALISING = {"subclassed_add_weight": "vectorized"}
KEY = tf.constant([3, 7], tf.int64)


def jitter(example, seed):
    """A view of one example: its floating-point inputs plus Gaussian noise (std 0.1) from ``seed``;
    token ids as they are."""
    def view(t):
        if not t.dtype.is_floating:
            return t
        return t + tf.cast(0.1 * tf.random.stateless_normal(tf.shape(t), seed), t.dtype)

    return tf.nest.map_structure(view, example)


def _views() -> AugmentationMultiplicity:
    return AugmentationMultiplicity(VIEWS, jitter, seed=0)


def _step(case, engine, jit: bool):
    views = _views()

    def step(x, y, valid, clip_norm):
        rows, labels, usable = views.expand(x, y, valid, KEY)
        return clipped_batch(engine, rows, labels, loss_fn, usable, clip_norm).sums, rows, labels

    signature = [case.signature(), tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.bool),
                 tf.TensorSpec([], tf.float32)]
    return tf.function(step, input_signature=signature, jit_compile=jit)


def view_reference_gradients(model, rows, labels, valid) -> list[list[np.ndarray]]:
    """Per real example: the mean over its views (``rows``, as the step drew them: XLA's random
    numbers are not TensorFlow's) of each view's gradient taken alone (float64)."""
    variables = model.trainable_variables
    per_example = []
    for i in np.flatnonzero(valid):
        total = None
        for k in range(VIEWS):
            row = i * VIEWS + k
            view = tf.nest.map_structure(lambda t: t[row : row + 1], rows)
            with tf.GradientTape() as tape:
                loss = loss_fn(labels[row : row + 1], model(view, training=True))[0]
            grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            grads = [np.asarray(tf.convert_to_tensor(g), np.float64) / VIEWS for g in grads]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        per_example.append(total)
    return per_example


XLA_CASES = ("dense_relu", "conv2d_valid_strides_relu", "depthwise_conv2d_strides_same", "lstm_masked",
             "multi_head_attention_masked", "shared_layer", "nested_model", "time_distributed_conv2d",
             "two_inputs", "mixed_bfloat16")
"""One model of each layer family: the auto engine's step compiled with XLA, and the materialising engine."""

# Every model with the auto engine; the materialising engine on one model of each family, on Keras 2 only: the
# view code is the same for every engine and Keras line, and test_layer_zoo checks every engine's rules on every
# model (CI runs this file on the TF 2.15 line).
ENGINE_CASES = [(name, "auto") for name in sorted(CASES)] + \
    ([] if KERAS3 else [(name, "materialising") for name in XLA_CASES])


def test_the_xla_cases_are_zoo_models():
    assert set(XLA_CASES) <= set(CASES)


@pytest.mark.parametrize("name, engine_name", ENGINE_CASES)
def test_k_view_clipped_sum_equals_the_one_example_reference(name, engine_name):
    case = CASES[name]
    tf.keras.utils.set_random_seed(0)
    model = case.build()
    x, y, valid = case.batch(seed=1)
    chosen = "auto" if engine_name == "auto" else MATERIALISING.get(name, "layerwise")
    engine = make_engine(model, model.trainable_variables, chosen, views=VIEWS)
    tolerance = LOW_PRECISION_TOLERANCE if case.low_precision else FLOAT_TOLERANCE
    # Under XLA: the auto engine on one model of each family (dense, convolution, recurrent, attention,
    # shared and nested layers, time steps, two inputs, low precision). XLA runs the same view code; every
    # rule is checked under XLA by test_layer_zoo, and the compiles cost most of this file's time.
    for jit in (False, True) if engine_name == "auto" and name in XLA_CASES else (False,):
        step = _step(case, engine, jit)
        _, rows, labels = step(x, y, valid, np.float32(1.0))
        reference = view_reference_gradients(model, rows, labels, valid)
        example_norms = norms(reference)
        for clip_norm in (np.median(example_norms), example_norms.max() * 2):
            ours = flat(step(x, y, valid, np.float32(clip_norm))[0])
            assert_matches_reference(ours, reference_clipped_sum(reference, clip_norm), model.trainable_variables,
                                     tolerance, f"jit={jit} C={clip_norm:.3g}")
        assert_one_example_is_isolated_and_bounded(lambda *args: step(*args)[0], case, x, y, valid,
                                                   np.float32(example_norms[0] / 10), model.trainable_variables, jit)
