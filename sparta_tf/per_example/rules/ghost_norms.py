"""The norm algebra of a linear map ``g_i = a_i^T delta_i``: rank one, ghost norm, direct.

With ``a_i: [T, d]`` the layer's input at ``T`` positions and ``delta_i: [T, p]`` its output
gradient (``T = 1`` on 2-D input), the per-example gradient of a linear map is
``g_i = a_i^T delta_i`` and::

    T = 1:  ||g_i||^2 = ||a_i||^2 ||delta_i||^2                      (rank one)
    T > 1:  ||g_i||^2 = <a_i a_i^T, delta_i delta_i^T>_F            (ghost norm, cost T^2 (d + p))
            or ||a_i^T delta_i||^2 computed for this layer alone     (direct, cost T d p)

whichever :func:`choose_linear_norm` finds cheaper. The clipped sum needs no per-example
gradient: ``S = sum_i a_i^T (c_i delta_i)``, one matmul over ``B*T`` rows (:func:`linear_sum`).
Dense, EinsumDense, convolutions (on im2col patches) and embeddings (with index equality as the
input Gram) share it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

Tensor = tf.Tensor


def choose_linear_norm(positions: int | None, fan_in: int, rows: int) -> tuple[str, int | None, int | None]:
    """``(method, ghost cost, direct cost)`` for ``g_i = a_i^T delta_i``, ``a_i: [T, d]``, ``delta_i: [T, p]``.

    ``T = 1``: rank one. Otherwise the ghost norm costs ``T^2 (d + p)`` and the
    direct per-example gradient ``T d p``; the cheaper one is used (ties: direct).
    ``T`` unknown when the step is traced (a dynamic sequence length): direct, exact for any ``T``.
    """
    if positions is None:
        return "direct", None, None
    direct = positions * fan_in * rows
    if positions == 1:
        return "rank_one", None, direct
    ghost = positions * positions * (fan_in + rows)
    return ("ghost" if ghost < direct else "direct"), ghost, direct


def linear_squared_norms(a: Tensor, d: Tensor, method: str) -> Tensor:
    """``[B]``: ``||a_i^T d_i||_F^2`` for ``a: [B, T, in]``, ``d: [B, T, k]`` by ``method``."""
    if method == "rank_one":
        return tf.reduce_sum(tf.square(a), axis=[1, 2]) * tf.reduce_sum(tf.square(d), axis=[1, 2])
    if method == "ghost":
        gram_a = tf.matmul(a, a, transpose_b=True)  # [B, T, T]
        gram_d = tf.matmul(d, d, transpose_b=True)
        return gram_squared_norms(gram_a, gram_d, 2 * tf.shape(a)[1] + a.shape[-1] + d.shape[-1])
    return tf.reduce_sum(tf.square(tf.matmul(a, d, transpose_a=True)), axis=[1, 2])


def unit_roundoff(dtype: tf.DType) -> float:
    """``u``: half the machine epsilon of ``dtype`` (2^-24 for float32)."""
    return float(np.finfo(dtype.as_numpy_dtype).eps) / 2.0


def gram_squared_norms(gram_a: Tensor, gram_d: Tensor, chain) -> Tensor:
    """``[B]``: ``sum_{t,s} gram_a[t,s] gram_d[t,s]`` raised past its rounding error, so that it is
    never below ``||g_i||^2`` (the ghost norm of ``g_i = sum_t a_t d_t^T``, ``gram = [<x_t, x_s>]``).

    In exact arithmetic the sum is ``||g_i||^2 >= 0``. In floating point its ``T^2`` terms can
    cancel: when an example's positions nearly cancel in ``g_i``, the computed sum can fall far
    below the true squared norm, to zero or below, and the example would escape clipping (one
    crafted example could contribute many times ``C``). The bound: with
    ``R_i = sum_t ||a_t|| ||d_t||`` (from the Grams' diagonals), Cauchy-Schwarz gives
    ``sum_{t,s} |gram_a[t,s] gram_d[t,s]| <= R_i^2``, so the rounding error of the Grams' inner
    products, the products and the sum (over ``s``, then over ``t``) is at most ``gamma_n R_i^2``
    with ``gamma_n = n u / (1 - n u)``, ``n = chain`` (``2T`` plus the Grams' inner lengths) and
    ``u`` the unit roundoff. Returned: ``max(sum, 0) + 2 gamma_n R_i^2`` (doubled for the rounding
    of the bound itself). An ordinary example, whose positions do not cancel, pays at most about
    ``2 gamma_n T`` of its squared norm (0.6% for ResNet-20-GN's 8x8 convolutions, ``n = 768``;
    less where positions correlate): it is clipped slightly more.

    ``u`` is that of IEEE arithmetic in the Grams' dtype: CPUs, and GPUs with TensorFloat-32 off.
    TensorFloat-32 matmuls (TensorFlow's default on Ampere and newer GPUs) and bfloat16 TPU
    matmuls round inputs to 10 and 7 mantissa bits, beyond what this bound covers; a DP step
    turns TensorFloat-32 off (:mod:`sparta_tf.precision`).
    """
    dtype = gram_a.dtype
    raw = tf.reduce_sum(tf.reduce_sum(gram_a * gram_d, axis=2), axis=1)  # two sums of T terms
    diagonal_a = tf.maximum(tf.linalg.diag_part(gram_a), 0.0)
    diagonal_d = tf.maximum(tf.linalg.diag_part(gram_d), 0.0)
    triangle = tf.reduce_sum(tf.sqrt(diagonal_a * diagonal_d), axis=1)  # R_i
    length_u = tf.cast(chain, dtype) * unit_roundoff(dtype)
    gamma = length_u / (1.0 - length_u)
    return tf.maximum(raw, 0.0) + 2.0 * gamma * tf.square(triangle)


def linear_sum(a: Tensor, d: Tensor) -> Tensor:
    """``sum_i a_i^T d_i``: ``[in, k]`` from ``a: [B, T, in]``, ``d: [B, T, k]`` (one matmul over ``B*T``)."""
    return tf.matmul(tf.reshape(a, [-1, a.shape[-1]]), tf.reshape(d, [-1, d.shape[-1]]), transpose_a=True)
