"""LayerNormalization and GroupNormalization: per-example gradients directly, ``[B, C]``.

``y = gamma x^ + beta`` acts elementwise on the layer's own normalised input ``x^``, so::

    dL_i/dgamma = sum_{t not in axis} delta_it x^_it        dL_i/dbeta = sum_{t not in axis} delta_it

with ``x^`` recomputed from the layer input exactly as the layer normalises it (moments over the
layer's axes, any ``axis`` and lists of axes, or per group with GroupNormalization's ``mask``
weights, and its epsilon); ``center`` / ``scale`` in any combination (an absent parameter is
simply not a variable). Book-keeping reduces these cheap per-example gradients to norms.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.per_example.registry import register_layer_rule
from sparta_tf.per_example.rules.base import LayerRule

Tensor = tf.Tensor


def _sum_except(t: Tensor, kept_axes) -> Tensor:
    """``t`` summed over every axis except the batch axis and ``kept_axes`` (positive, sorted)."""
    axes = [a for a in range(1, t.shape.rank) if a not in kept_axes]
    return tf.reduce_sum(t, axis=axes) if axes else t


class NormalizationRule(LayerRule):
    """LayerNormalization and GroupNormalization (see module doc)."""

    norm_method = "elementwise"

    def variable_grad(self, layer, call, delta, selection):
        parameter_axes = _parameter_axes(layer, delta.shape.rank)
        if selection.variable is getattr(layer, "gamma", None):
            per_position = delta * normalized(layer, call, delta.dtype)
        elif selection.variable is getattr(layer, "beta", None):
            per_position = delta
        else:
            raise ValueError(f"{type(layer).__name__} rule cannot handle variable {variable_key(selection.variable)}")
        grads = _sum_except(per_position, parameter_axes)
        return tf.reshape(grads, tf.concat([tf.shape(grads)[:1], selection.shape], 0))


def _parameter_axes(layer, rank: int) -> list[int]:
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    return sorted(a % rank for a in axes)


def normalized(layer, call, dtype) -> Tensor:
    """``x^``: the layer input normalised exactly as ``layer`` does it, in ``dtype``."""
    x = tf.cast(call.inputs, dtype)
    if isinstance(layer, tf.keras.layers.GroupNormalization):
        return _group_normalized(layer, x, call.kwargs.get("mask"))
    mean, variance = tf.nn.moments(x, _parameter_axes(layer, x.shape.rank), keepdims=True)
    return tf.nn.batch_normalization(x, mean, variance, None, None, layer.epsilon)


def _group_normalized(layer, x: Tensor, mask) -> Tensor:
    axis = layer.axis % x.shape.rank
    shape = tf.shape(x)
    grouped_shape = tf.concat([shape[:axis], [layer.groups, shape[axis] // layer.groups], shape[axis + 1:]], 0)
    grouped = tf.reshape(x, grouped_shape)
    weights = tf.ones_like(grouped) if mask is None else tf.reshape(
        tf.cast(tf.broadcast_to(mask, shape), x.dtype), grouped_shape)
    axes = [a for a in range(1, x.shape.rank + 1) if a != axis]
    mean, variance = tf.nn.weighted_moments(grouped, axes, frequency_weights=weights, keepdims=True)
    normalized_ = tf.nn.batch_normalization(grouped, mean, variance, None, None, layer.epsilon)
    return tf.reshape(normalized_, shape)


NORMALIZATION_RULE = NormalizationRule()
register_layer_rule(tf.keras.layers.LayerNormalization, NORMALIZATION_RULE, verify=False)
register_layer_rule(tf.keras.layers.GroupNormalization, NORMALIZATION_RULE, verify=False)
