"""Per-example gradients of elementwise-parametrised layers: normalisation layers and PReLU.

Their weights act elementwise on the layer's own input, so per-example gradients are cheap
(``[B, *weight.shape]``, computed directly from the recorded input and output gradient):

* LayerNormalization (any ``axis``, a list of axes included) and GroupNormalization (any
  ``axis``, with its ``mask``), ``y = gamma x^ + beta``::

      dL_i/dgamma = sum_{t not in axis} delta_it x^_it        dL_i/dbeta = sum_{t not in axis} delta_it

  with ``x^`` recomputed from the layer input exactly as the layer normalises it (moments over the
  layer's axes, or per group with the mask's weights, and its epsilon); ``center`` / ``scale`` in
  any combination (an absent parameter is simply not a variable).
* PReLU, ``y = relu(x) - alpha relu(-x)``: ``dL_i/dalpha = sum_{shared axes} -delta_i relu(-x_i)``.
* The ViT's learned tokens (:mod:`sparta_tf.models.vit`): ``PositionEmbedding``, ``y = x + E``:
  ``dL_i/dE = delta_i``; ``ClassToken``, ``y = [c, x]``: ``dL_i/dc = delta_i[0]``.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.per_example.layer_rules import LayerRule

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


class PReLURule(LayerRule):
    """PReLU: ``dL_i/dalpha = sum over the shared axes of -delta_i relu(-x_i)``."""

    norm_method = "elementwise"

    def variable_grad(self, layer, call, delta, selection):
        per_position = -delta * tf.nn.relu(-tf.cast(call.inputs, delta.dtype))
        shared = [a for a in (layer.shared_axes or [])]
        if shared:
            per_position = tf.reduce_sum(per_position, axis=shared, keepdims=True)
        return per_position


class LearnedTokenRule(LayerRule):
    """PositionEmbedding (``dL_i/dE = delta_i``) and ClassToken (``dL_i/dc = delta_i[0]``)."""

    norm_method = "elementwise"

    def __init__(self, first_token_only: bool):
        self.first_token_only = first_token_only

    def variable_grad(self, layer, call, delta, selection):
        grads = delta[:, :1] if self.first_token_only else delta
        return tf.reshape(grads, tf.concat([tf.shape(grads)[:1], selection.shape], 0))


NORMALIZATION_RULE = NormalizationRule()
CLASS_TOKEN_RULE = LearnedTokenRule(first_token_only=True)
POSITION_EMBEDDING_RULE = LearnedTokenRule(first_token_only=False)
PRELU_RULE = PReLURule()
