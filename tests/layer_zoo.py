"""A zoo of small models written the way users write them, and a one-example tape reference.

Each case builds a model from ordinary Keras layers (fused activations, masks,
recurrent layers, wrappers, mixed precision, unknown dimensions) and a batch for
it. The reference is independent of the engines: every example's gradient taken
alone with ``tf.GradientTape`` over all trainable variables, clipped to ``C``,
summed in float64.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf

from sparta_tf.models import vit_tiny

L = tf.keras.layers
CLASSES = 3
BATCH = 4  # real examples; two padding rows follow them
PADDING = 2


def loss_fn(y, logits):
    return tf.keras.losses.sparse_categorical_crossentropy(y, tf.cast(logits, tf.float32), from_logits=True)


@dataclasses.dataclass(frozen=True)
class Case:
    """A model builder, the shape of one example's input(s) (None: a dimension the model leaves
    unknown, filled with ``sizes`` in the batch) and the input kind: ``float`` or ``ids``."""

    build: Callable[[], tf.keras.Model]
    shapes: tuple  # one shape per input
    kinds: tuple = ("float",)
    sizes: tuple = ()  # concrete sizes of the None dimensions, per input
    low_precision: bool = False

    def batch(self, seed: int, padding_fill: str = "nan"):
        """``(x, y, valid)``: BATCH real examples then PADDING rows (NaN, or other ids / values)."""
        rs = np.random.RandomState(seed)
        xs = []
        for shape, kind, sizes in zip(self.shapes, self.kinds, self.sizes or ((),) * len(self.shapes)):
            sizes = iter(sizes)
            concrete = [next(sizes) if d is None else d for d in shape]
            if kind == "ids":
                x = rs.randint(1, 9, (BATCH + PADDING, *concrete)).astype(np.int32)
                x[:, -2:] *= rs.rand(BATCH + PADDING, 2) < 0.5  # some trailing zeros: masked steps
            else:
                x = rs.randn(BATCH + PADDING, *concrete).astype(np.float32)
                if padding_fill == "nan":
                    x[BATCH:] = np.nan
            xs.append(x)
        y = rs.randint(0, CLASSES, BATCH + PADDING)
        valid = np.arange(BATCH + PADDING) < BATCH
        return (xs[0] if len(xs) == 1 else xs), y, valid

    def signature(self):
        """Input specs with the batch and every dimension the model leaves unknown set to None."""
        specs = [tf.TensorSpec([None, *shape], tf.int32 if kind == "ids" else tf.float32)
                 for shape, kind in zip(self.shapes, self.kinds)]
        return specs[0] if len(specs) == 1 else specs


def _head(h):
    return L.Dense(CLASSES, dtype="float32")(h)


def _on(shape, body, dtype=tf.float32):
    """A functional model: Input(shape) -> body -> Dense head."""
    inputs = tf.keras.Input(shape, dtype=dtype)
    return tf.keras.Model(inputs, _head(body(inputs)))


def _pool_sequence(h):
    return L.GlobalAveragePooling1D()(h)


def _pool_image(h):
    return L.GlobalAveragePooling2D()(h)


# ------------------------------------------------------------------ custom layers


class MaskedScale(L.Layer):
    """A custom layer with ``call(x, mask=None)``: a per-channel scale, masked steps zeroed."""

    def build(self, shape):
        self.w = self.add_weight(name="w", shape=shape[-1:], initializer="random_normal")

    def call(self, x, mask=None):
        y = x * self.w
        if mask is not None:
            y = y * tf.cast(mask, y.dtype)[..., None]
        return y


class MinimalCell(L.Layer):
    """A custom RNN cell: ``h_t = tanh(x_t W + h_{t-1} U)``."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = units

    def build(self, shape):
        self.w = self.add_weight(name="w", shape=(shape[-1], self.units), initializer="glorot_uniform")
        self.u = self.add_weight(name="u", shape=(self.units, self.units), initializer="orthogonal")

    def call(self, x, states):
        h = tf.tanh(tf.matmul(x, self.w) + tf.matmul(states[0], self.u))
        return h, [h]


class SubclassedWithOwnWeight(tf.keras.Model):
    """A subclassed model whose own ``add_weight`` is used in ``call`` (owned by no leaf layer)."""

    def __init__(self):
        super().__init__()
        self.dense = L.Dense(4, activation="relu")
        self.head = L.Dense(CLASSES)

    def build(self, shape):
        self.gain = self.add_weight(name="gain", shape=(4,), initializer="ones")
        self.dense.build(shape)  # Keras 3's Model.build does not call the model to build its layers
        self.head.build((*shape[:-1], 4))
        super().build(shape)

    def call(self, x):
        return self.head(self.dense(x) * self.gain)


def _mha_masked(ids):
    e = L.Embedding(10, 4, mask_zero=True)(ids)
    return _pool_sequence(L.MultiHeadAttention(num_heads=2, key_dim=3)(e, e))


def _attention_masked(ids):
    e = L.Embedding(10, 4, mask_zero=True)(ids)
    return _pool_sequence(L.Attention(use_scale=True)([e, e]))


def _shared(x):
    dense = L.Dense(5, activation="tanh")
    return dense(L.Dense(5)(dense(x)))


def _nested(x):
    inner = tf.keras.Sequential([L.Dense(4, activation="relu"), L.LayerNormalization()], name="inner")
    return inner(x)


def _frozen(x):
    frozen = L.Dense(4, activation="relu")
    frozen.trainable = False
    return L.Dense(4)(frozen(x))


def _two_inputs():
    image = tf.keras.Input((5, 5, 2))
    vector = tf.keras.Input((3,))
    h = L.Concatenate()([_pool_image(L.Conv2D(3, 3, activation="relu")(image)), L.Dense(3)(vector)])
    return tf.keras.Model([image, vector], _head(h))


def _subclassed():
    model = SubclassedWithOwnWeight()
    model.build((None, 4))
    return model


def _mixed(policy):
    def build():
        inputs = tf.keras.Input((6, 6, 2))
        h = L.Conv2D(4, 3, activation="relu", dtype=policy)(inputs)
        h = L.GroupNormalization(2, dtype=policy)(h)
        h = L.Dense(4, activation="gelu", dtype=policy)(_pool_image(h))
        return tf.keras.Model(inputs, _head(h))
    return build


SEQUENCE, IMAGE = (None, 3), (None, None, 2)

CASES: dict[str, Case] = {
    # linear layers, with fused activations and without biases
    "dense_relu": Case(lambda: _on((4,), lambda x: L.Dense(5, activation="relu")(x)), ((4,),)),
    "dense_tanh_no_bias": Case(lambda: _on((4,), lambda x: L.Dense(5, activation="tanh", use_bias=False)(x)), ((4,),)),
    "dense_sequence_gelu": Case(lambda: _on(SEQUENCE, lambda x: _pool_sequence(L.Dense(4, activation="gelu")(x))),
                                (SEQUENCE,), sizes=((5,),)),
    "einsum_dense_relu": Case(lambda: _on(SEQUENCE, lambda x: _pool_sequence(
        L.EinsumDense("abc,cd->abd", output_shape=(None, 4), bias_axes="d", activation="relu")(x))),
        (SEQUENCE,), sizes=((5,),)),
    # convolutions
    "conv1d_causal_dilated": Case(lambda: _on(SEQUENCE, lambda x: _pool_sequence(
        L.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="relu")(x))), (SEQUENCE,), sizes=((7,),)),
    "conv1d_groups_strides": Case(lambda: _on((None, 4), lambda x: _pool_sequence(
        L.Conv1D(4, 3, strides=2, groups=2)(x))), ((None, 4),), sizes=((7,),)),
    "conv2d_valid_strides_relu": Case(lambda: _on(IMAGE, lambda x: _pool_image(
        L.Conv2D(3, 3, strides=2, activation="relu")(x))), (IMAGE,), sizes=((7, 6),)),
    "conv2d_same_dilated_no_bias": Case(lambda: _on(IMAGE, lambda x: _pool_image(
        L.Conv2D(3, 3, dilation_rate=2, padding="same", use_bias=False)(x))), (IMAGE,), sizes=((6, 6),)),
    "conv2d_groups": Case(lambda: _on((None, None, 4), lambda x: _pool_image(
        L.Conv2D(4, 3, groups=2, padding="same", activation="relu")(x))), ((None, None, 4),), sizes=((5, 5),)),
    "conv3d": Case(lambda: _on((3, 4, 4, 2), lambda x: L.GlobalAveragePooling3D()(
        L.Conv3D(3, 2, activation="relu")(x))), ((3, 4, 4, 2),)),
    "conv2d_transpose": Case(lambda: _on(IMAGE, lambda x: _pool_image(
        L.Conv2DTranspose(3, 3, strides=2, padding="same", activation="relu")(x))), (IMAGE,), sizes=((4, 4),)),
    "depthwise_conv2d": Case(lambda: _on(IMAGE, lambda x: _pool_image(
        L.DepthwiseConv2D(3, depth_multiplier=2, activation="relu")(x))), (IMAGE,), sizes=((5, 5),)),
    # static maps: the examples folded into the channels (output map >= kernel), per-tap sums (smaller)
    "depthwise_conv2d_strides_same": Case(lambda: _on((7, 6, 2), lambda x: _pool_image(
        L.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=3)(x))), ((7, 6, 2),)),
    "depthwise_conv2d_small_map": Case(lambda: _on((2, 3, 2), lambda x: _pool_image(
        L.DepthwiseConv2D(3, padding="same", depth_multiplier=2)(x))), ((2, 3, 2),)),
    "depthwise_conv2d_small_map_strides": Case(lambda: _on((3, 3, 2), lambda x: _pool_image(
        L.DepthwiseConv2D(3, strides=2, padding="same")(x))), ((3, 3, 2),)),
    "depthwise_conv2d_dilated": Case(lambda: _on(IMAGE, lambda x: _pool_image(
        L.DepthwiseConv2D(2, dilation_rate=2, padding="same", use_bias=False)(x))), (IMAGE,), sizes=((6, 5),)),
    "separable_conv2d_strides": Case(lambda: _on((7, 7, 2), lambda x: _pool_image(
        L.SeparableConv2D(4, 3, strides=2, depth_multiplier=2)(x))), ((7, 7, 2),)),
    "separable_conv2d": Case(lambda: _on(IMAGE, lambda x: _pool_image(
        L.SeparableConv2D(4, 3, padding="same", activation="relu")(x))), (IMAGE,), sizes=((5, 5),)),
    # embeddings, masks, attention
    "embedding_unknown_length": Case(lambda: _on((None,), lambda x: _pool_sequence(L.Embedding(10, 4)(x)),
                                                 tf.int32), ((None,),), ("ids",), ((6,),)),
    "embedding_mask_zero": Case(lambda: _on((None,), lambda x: _pool_sequence(
        L.Embedding(10, 4, mask_zero=True)(x)), tf.int32), ((None,),), ("ids",), ((6,),)),
    "custom_layer_with_mask": Case(lambda: _on((None,), lambda x: _pool_sequence(
        MaskedScale()(L.Embedding(10, 4, mask_zero=True)(x))), tf.int32), ((None,),), ("ids",), ((6,),)),
    "attention_masked": Case(lambda: _on((None,), _attention_masked, tf.int32), ((None,),), ("ids",), ((6,),)),
    "multi_head_attention_masked": Case(lambda: _on((None,), _mha_masked, tf.int32), ((None,),), ("ids",), ((6,),)),
    "multi_head_attention_causal": Case(lambda: _on(SEQUENCE, lambda x: _pool_sequence(
        L.MultiHeadAttention(num_heads=2, key_dim=3)(x, x, use_causal_mask=True))), (SEQUENCE,), sizes=((5,),)),
    # normalisation and other parametrised activations
    "layer_norm": Case(lambda: _on(SEQUENCE, lambda x: _pool_sequence(L.LayerNormalization()(x))),
                       (SEQUENCE,), sizes=((5,),)),
    "layer_norm_no_center": Case(lambda: _on(SEQUENCE, lambda x: _pool_sequence(
        L.LayerNormalization(center=False)(x))), (SEQUENCE,), sizes=((5,),)),
    "layer_norm_no_scale_axes_1_2": Case(lambda: _on((4, 4, 2), lambda x: _pool_image(
        L.LayerNormalization(axis=[1, 2], scale=False)(x))), ((4, 4, 2),)),
    "group_norm_no_center": Case(lambda: _on((None, None, 4), lambda x: _pool_image(
        L.GroupNormalization(2, center=False)(x))), ((None, None, 4),), sizes=((4, 4),)),
    "group_norm_sequence": Case(lambda: _on((None, 4), lambda x: _pool_sequence(
        L.GroupNormalization(2)(x))), ((None, 4),), sizes=((5,),)),
    "group_norm_channels_first": Case(lambda: _on((4, 3, 3), lambda x: _pool_image(
        L.GroupNormalization(2, axis=1)(x))), ((4, 3, 3),)),
    "prelu": Case(lambda: _on((4,), lambda x: L.PReLU()(L.Dense(4)(x))), ((4,),)),
    # recurrent layers
    "lstm": Case(lambda: _on(SEQUENCE, lambda x: L.LSTM(4)(x)), (SEQUENCE,), sizes=((5,),)),
    "gru_sequences": Case(lambda: _on(SEQUENCE, lambda x: _pool_sequence(L.GRU(4, return_sequences=True)(x))),
                          (SEQUENCE,), sizes=((5,),)),
    "gru_reset_before_backwards": Case(lambda: _on(SEQUENCE, lambda x: L.GRU(4, reset_after=False,
                                                                            go_backwards=True)(x)),
                                       (SEQUENCE,), sizes=((5,),)),
    "simple_rnn": Case(lambda: _on(SEQUENCE, lambda x: L.SimpleRNN(4)(x)), (SEQUENCE,), sizes=((5,),)),
    "bidirectional_lstm": Case(lambda: _on(SEQUENCE, lambda x: _pool_sequence(
        L.Bidirectional(L.LSTM(3, return_sequences=True))(x))), (SEQUENCE,), sizes=((5,),)),
    "lstm_masked": Case(lambda: _on((None,), lambda x: L.LSTM(4)(L.Embedding(10, 3, mask_zero=True)(x)),
                                    tf.int32), ((None,),), ("ids",), ((6,),)),
    "rnn_custom_cell": Case(lambda: _on(SEQUENCE, lambda x: L.RNN(MinimalCell(4))(x)), (SEQUENCE,), sizes=((5,),)),
    "rnn_stacked_cells": Case(lambda: _on(SEQUENCE, lambda x: L.RNN(
        L.StackedRNNCells([L.LSTMCell(3), L.GRUCell(3)]))(x)), (SEQUENCE,), sizes=((5,),)),
    # wrappers, structure
    "time_distributed_dense": Case(lambda: _on(SEQUENCE, lambda x: _pool_sequence(
        L.TimeDistributed(L.Dense(4, activation="relu"))(x))), (SEQUENCE,), sizes=((5,),)),
    "time_distributed_conv2d": Case(lambda: _on((3, 5, 5, 2), lambda x: L.Flatten()(
        L.TimeDistributed(L.Conv2D(2, 3))(x))), ((3, 5, 5, 2),)),
    "nested_model": Case(lambda: _on((4,), _nested), ((4,),)),
    "shared_layer": Case(lambda: _on((5,), _shared), ((5,),)),
    "frozen_layer": Case(lambda: _on((4,), _frozen), ((4,),)),
    "subclassed_add_weight": Case(_subclassed, ((4,),)),
    "two_inputs": Case(_two_inputs, ((5, 5, 2), (3,)), ("float", "float")),
    "vit": Case(lambda: vit_tiny(num_classes=CLASSES, input_shape=(8, 8, 2), patch_size=4, dim=8, depth=1, heads=2,
                                 mlp_dim=16), ((8, 8, 2),)),
    # precision
    "mixed_bfloat16": Case(_mixed("mixed_bfloat16"), ((6, 6, 2),), low_precision=True),
    "mixed_float16": Case(_mixed("mixed_float16"), ((6, 6, 2),), low_precision=True),
    "bfloat16": Case(_mixed("bfloat16"), ((6, 6, 2),), low_precision=True),
    "float64": Case(_mixed("float64"), ((6, 6, 2),)),
}


def reference_gradients(model, x, y, valid) -> list[list[np.ndarray]]:
    """Per real example: its gradient alone (float64), over every trainable variable."""
    variables = model.trainable_variables
    per_example = []
    for i in np.flatnonzero(valid):
        example = tf.nest.map_structure(lambda t: t[i : i + 1], x)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i : i + 1], model(example, training=True))[0]
        grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        per_example.append([np.asarray(tf.convert_to_tensor(g), np.float64) for g in grads])
    return per_example


def reference_clipped_sum(per_example, clip_norm: float) -> list[np.ndarray]:
    """``sum_i g_i min(1, C/||g_i||)`` in float64."""
    total = [np.zeros_like(g) for g in per_example[0]]
    for grads in per_example:
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads))
        factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


def norms(per_example) -> np.ndarray:
    return np.array([np.sqrt(sum(float(np.sum(g * g)) for g in grads)) for grads in per_example])


def flat(sums) -> list[np.ndarray]:
    """A step's sums as float64 arrays."""
    return [np.asarray(s, np.float64) for s in sums]


def assert_matches_reference(ours: list, expected: list, variables, tolerance: float, context: str) -> None:
    """Every variable's sum within ``tolerance`` of the reference, relative to its largest coordinate."""
    scale = max(float(np.max(np.abs(e))) for e in expected)
    for variable, a, b in zip(variables, ours, expected):
        error = float(np.max(np.abs(a - b), initial=0.0)) / scale
        assert error <= tolerance, f"{variable.name} {context}: {error:.2e}"


def assert_one_example_is_isolated_and_bounded(step, case: "Case", x, y, valid, clip_norm, variables, jit: bool) -> None:
    """With only the first example real, its clipped sum (``step(x, y, valid, C) -> sums``) is
    bit-identical whatever the other rows hold (NaN padding or other values), and at most ``C``."""
    single = np.arange(len(valid)) == 0
    first = flat(step(x, y, single, clip_norm))
    others_x, _, _ = case.batch(seed=2, padding_fill="values")
    mixed = tf.nest.map_structure(lambda a, b: np.concatenate([a[:1], b[1:]]), x, others_x)
    again = flat(step(mixed, y, single, clip_norm))
    for variable, a, b in zip(variables, first, again):
        np.testing.assert_array_equal(a, b, err_msg=f"{variable.name} jit={jit}: depends on other rows")
    assert np.sqrt(sum(float(np.sum(a * a)) for a in first)) <= clip_norm, f"jit={jit}: ||S|| > C"
