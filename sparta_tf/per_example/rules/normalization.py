"""LayerNormalization and GroupNormalization: per-example gradients directly, ``[B, C]``.

``y = gamma x^ + beta`` acts elementwise on the layer's own normalised input ``x^``, so::

    dL_i/dgamma = sum_{t not in axis} delta_it x^_it        dL_i/dbeta = sum_{t not in axis} delta_it

with ``x^`` recomputed from the layer input as the layer normalises it (moments over the
layer's axes, any ``axis`` and lists of axes, or per group with GroupNormalization's ``mask``
weights, and its epsilon; for GroupNormalization the group's ``1/sqrt(var + eps)`` multiplies the
summed gradient, not ``x^``); ``center`` / ``scale`` in any combination (an absent parameter is
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
        if selection.variable is getattr(layer, "gamma", None) and isinstance(layer, tf.keras.layers.GroupNormalization):
            grads = group_gamma_grads(layer, call, delta)
            return tf.reshape(grads, tf.concat([tf.shape(grads)[:1], selection.shape], 0))
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
    """``x^``: the LayerNormalization input normalised as the layer does it, in ``dtype``."""
    x = tf.cast(call.inputs, dtype)
    mean, variance = tf.nn.moments(x, _parameter_axes(layer, x.shape.rank), keepdims=True)
    return tf.nn.batch_normalization(x, mean, variance, None, None, layer.epsilon)


def group_gamma_grads(layer, call, delta: Tensor) -> Tensor:
    """GroupNormalization's ``dL_i/dgamma[c] = r_ig sum_t delta_itc (x_itc - mu_ig)``, ``[B, C]``.

    ``mu_ig`` and ``r_ig = 1/sqrt(var_ig + eps)`` are example ``i``'s moments over group ``g`` of
    channel ``c`` (every position and the group's channels, weighted by the call's ``mask`` where
    it has one), as the layer normalises; ``r`` is constant over the positions ``t`` summed, so it
    multiplies the ``[B, C]`` sum instead of every coordinate of ``x^``."""
    x = tf.cast(call.inputs, delta.dtype)
    axis = layer.axis % x.shape.rank
    shape = tf.shape(x)
    grouped_shape = tf.concat([shape[:axis], [layer.groups, shape[axis] // layer.groups], shape[axis + 1:]], 0)
    grouped = tf.reshape(x, grouped_shape)
    moment_axes = [a for a in range(1, x.shape.rank + 1) if a != axis]
    mask = call.kwargs.get("mask")
    if mask is None:
        mean, variance = tf.nn.moments(grouped, moment_axes, keepdims=True)
    else:
        weights = tf.reshape(tf.cast(tf.broadcast_to(mask, shape), x.dtype), grouped_shape)
        mean, variance = tf.nn.weighted_moments(grouped, moment_axes, frequency_weights=weights, keepdims=True)
    position_axes = [a for a in moment_axes if a != axis + 1]
    centred = tf.reshape(delta, grouped_shape) * (grouped - mean)
    summed = tf.reduce_sum(centred, axis=position_axes, keepdims=True) * tf.math.rsqrt(variance + layer.epsilon)
    return tf.reshape(summed, [shape[0], -1])


NORMALIZATION_RULE = NormalizationRule()
register_layer_rule(tf.keras.layers.LayerNormalization, NORMALIZATION_RULE, verify=False)
register_layer_rule(tf.keras.layers.GroupNormalization, NORMALIZATION_RULE, verify=False)
