"""Gaussian noise of the Gaussian mechanisms: ``N(0, sigma^2 C^2)`` on each released coordinate.

For the summed clipped gradient ``S_t`` of a DP-SGD step (sensitivity ``C``) and noise
multiplier ``sigma`` (:class:`GaussianNoise`, reading both from the model's
:class:`~sparta_tf.privacy.mechanism.DpSgdMechanism`)::

    S~_t = S_t + N(0, sigma^2 C^2 I)

in the dtype of each sum (float32; float64 for a float64 model), before any cast to a
variable's dtype.

Noise is drawn with stateless Philox from the run seed, a named stream of
:mod:`sparta_tf.random_streams` and the step ``t``::

    z_k^t = stateless_normal(shape_k, seed=fold_in(step_key(seed, stream, t), k))

for released tensor ``k``. DP-SGD and SPARTA's selection steps use the
stream ``"dp_sgd_noise"`` (one mechanism per global DP step, so the step
separates them); DP-SNIP and DP-FROST have streams of their own, so no two
mechanisms of a run ever share noise. Consequences:

* every replica of a ``tf.distribute`` strategy draws the *same* noise for the
  same step, so adding it after the all-reduce adds it exactly once;
* a resumed run draws the noise an uninterrupted run would have drawn;
* tests are reproducible with a fixed seed.

Seed policy: see :mod:`sparta_tf.random_streams` (the seed is secret; with
none given one is drawn from the OS's cryptographic source). Philox is
TensorFlow's standard counter-based generator (as in TF Privacy); like every
float Gaussian sampler it is not hardened against floating-point side
channels (Mironov 2012).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from sparta_tf.random_streams import TF_ALGORITHM, step_key

DP_SGD_NOISE = "dp_sgd_noise"


def gaussian_noise(
    shapes: Sequence[tf.TensorShape], stddev: tf.Tensor, seed: tf.Tensor, step: tf.Tensor,
    dtype=tf.float32, stream: str = DP_SGD_NOISE,
) -> list[tf.Tensor]:
    """Independent ``N(0, stddev^2)`` tensors of the given shapes for step ``step`` of ``stream``.

    ``dtype``: one dtype for every tensor, or one per shape (a float64 model's sums take float64
    noise)."""
    return [draw() for draw in _draw_functions(shapes, stddev, seed, step, dtype, stream)]


def noise_draws(shapes, stddev, seed, step, dtype=tf.float32, stream: str = DP_SGD_NOISE) -> list:
    """One function per tensor of :func:`gaussian_noise` that draws it (``z_k^t``, the same values),
    so that a caller can order the draws."""
    return _draw_functions(shapes, stddev, seed, step, dtype, stream)


def _draw_functions(shapes, stddev, seed, step, dtype, stream: str) -> list:
    key = step_key(seed, stream, step)
    dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)

    def draw(k: int, shape, tensor_dtype):
        sub_key = tf.random.experimental.stateless_fold_in(key, k, alg=TF_ALGORITHM)
        return tf.random.stateless_normal(shape, seed=sub_key, stddev=tf.cast(stddev, tensor_dtype),
                                          dtype=tensor_dtype, alg=TF_ALGORITHM)

    return [lambda k=k, shape=shape, tensor_dtype=tensor_dtype: draw(k, shape, tensor_dtype)
            for k, (shape, tensor_dtype) in enumerate(zip(shapes, dtypes))]


class GaussianNoise:
    """``S -> S + N(0, sigma^2 C^2 I)`` at step ``t``, ``sigma`` and ``C`` from ``mechanism`` (a
    :class:`~sparta_tf.privacy.mechanism.DpSgdMechanism`), drawn from the run's noise ``seed``, the
    ``"dp_sgd_noise"`` stream and the global DP step ``t`` (every replica draws the same noise, and a
    resumed run the noise an uninterrupted one would have drawn)."""

    def __init__(self, mechanism, seed: tf.Variable | tf.Tensor):
        self.mechanism = mechanism
        self.seed = seed

    def __call__(self, sums: list, step: tf.Tensor) -> list:
        """``S_k + z_k^t`` for each released tensor, one draw after the other: each noise tensor is
        added (and freed) before the next is drawn, so at most one is alive (TensorFlow would
        otherwise draw them all at once: for ResNet50V2's 23.5M coordinates a Keras step plus that
        draw grew 1.96x the Keras step's peak memory)."""
        noised: list = []
        draws = noise_draws([s.shape for s in sums], self.mechanism.noise_std, self.seed, step,
                            dtype=[s.dtype for s in sums])
        for total, draw in zip(sums, draws):
            with tf.control_dependencies(noised[-1:]):
                noised.append(total + draw())
        return noised
