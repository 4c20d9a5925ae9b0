"""Per-example L2 clipping over the trainable coordinates.

For per-example gradients ``g_i`` (restricted to the coordinates trainable in
this step) and clip norm ``C``::

    c_i = w_i * min(1, C / ||g_i||_2)        w_i = 1 for real examples, 0 for padding
    S   = sum_i c_i g_i                      so ||c_i g_i||_2 <= C for every i

This is the one clipped sum of the project: DP-SGD steps, DP-SNIP and
DP-FROST use it (DP-FROST's magnitudes clip in the L1 or L2 norm,
``order=1`` / ``order=2``: ``c_i = min(1, C / ||g_i||_order)``).

``S`` is the sum whose sensitivity the Gaussian mechanism of DP-SGD assumes.
Guarantees that the tests check:

* ``C / ||g||`` is computed with a relative safety margin of ``1e-6`` so that
  float32 rounding cannot push a clipped contribution above ``C``;
* padding examples (``w_i = 0``) and examples whose gradient is not finite
  (overflow, NaN) contribute exactly ``0``: their gradients are replaced by
  zeros with ``tf.where`` before summing, so ``0 * nan`` cannot leak in;
* norms are ``sqrt(sum(square(g)))`` per example (``tf.linalg.global_norm`` has
  no vectorised rule and would fall back to a loop).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from sparta_tf.example_rows import keep_examples

SAFETY_MARGIN = 1e-6


def per_example_squared_norms(grads: Sequence[tf.Tensor]) -> tf.Tensor:
    """``[B]``: ``sum_k ||grads[k][i]||^2`` over all per-example tensors ``[B, ...]``, in the
    accumulation dtype (:func:`sparta_tf.precision.accumulation_dtype`: float32 for bfloat16 /
    float16 gradients, whose squares would round past the clip bound or overflow)."""
    batch = tf.shape(grads[0])[0]
    grads = _common_accumulation(grads)
    return tf.add_n([tf.reduce_sum(tf.reshape(tf.square(g), [batch, -1]), axis=1) for g in grads])


def _common_accumulation(grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``grads`` in one accumulation dtype (float64 if any is float64, else float32)."""
    dtype = tf.float64 if any(g.dtype == tf.float64 for g in grads) else tf.float32
    return [tf.cast(g, dtype) for g in grads]


def per_example_l1_norms(grads: Sequence[tf.Tensor]) -> tf.Tensor:
    """``[B]``: ``sum_k ||grads[k][i]||_1`` over all per-example tensors ``[B, ...]``."""
    batch = tf.shape(grads[0])[0]
    return tf.add_n([tf.reduce_sum(tf.reshape(tf.abs(g), [batch, -1]), axis=1) for g in _common_accumulation(grads)])


def clip_factors(squared_norms: tf.Tensor, clip_norm: float, valid: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(c, keep)``: ``c_i = min(1, C / ||g_i||)`` for kept examples, else 0.

    An example is kept when it is real (``valid``) and its squared norm is
    finite and not negative (a negative one can only come from rounding, and
    its true norm is unknown: dropped, it contributes exactly zero, where
    ``c_i = 1`` could leave it unclipped); ``keep`` is returned so that callers
    can zero the gradients of the others exactly.
    """
    keep = tf.logical_and(valid, tf.logical_and(tf.math.is_finite(squared_norms), squared_norms >= 0))
    return _factors(tf.sqrt(tf.where(keep, squared_norms, tf.zeros_like(squared_norms))), keep, clip_norm), keep


def _factors(norms: tf.Tensor, keep: tf.Tensor, clip_norm: float) -> tf.Tensor:
    """``min(1, C / ||g_i||)`` (with the safety margin) where ``keep``, else 0."""
    clip_norm = tf.cast(clip_norm, norms.dtype)
    factors = tf.minimum(tf.cast(1.0, norms.dtype), clip_norm / (norms * (1.0 + SAFETY_MARGIN) + 1e-30))
    return tf.where(keep, factors, tf.zeros_like(factors))


def clipped_sum(
    grads: Sequence[tf.Tensor], clip_norm: float, valid: tf.Tensor, order: int = 2
) -> tuple[list[tf.Tensor], tf.Tensor]:
    """``(S, norms)``: the sum of clipped per-example gradients and the unclipped ``order``-norms."""
    if order == 2:
        squared = per_example_squared_norms(grads)
        factors, keep = clip_factors(squared, clip_norm, valid)
        norms = tf.sqrt(squared)
    elif order == 1:
        norms = per_example_l1_norms(grads)
        keep = tf.logical_and(valid, tf.math.is_finite(norms))
        factors = _factors(tf.where(keep, norms, tf.zeros_like(norms)), keep, clip_norm)
    else:
        raise ValueError(f"order={order!r}: clipping supports the L1 and L2 norms (order 1 or 2)")
    sums = []
    for g in _common_accumulation(grads):
        g = keep_examples(g, keep)
        sums.append(tf.tensordot(tf.cast(factors, g.dtype), g, axes=1))
    return sums, norms
