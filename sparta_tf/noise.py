"""Gaussian noise for DP-SGD: ``N(0, sigma^2 C^2)`` on each trainable coordinate.

Noise is drawn with stateless Philox from a key ``(seed, step, k)``::

    z_k^t = stateless_normal(shape_k, seed=fold_in(fold_in([seed, NOISE_DOMAIN], t), k))

for trainable tensor ``k`` at DP step ``t``. Consequences:

* every replica of a ``tf.distribute`` strategy draws the *same* noise for the
  same step, so adding it after the all-reduce adds it exactly once;
* a resumed run draws the noise an uninterrupted run would have drawn;
* tests are reproducible with a fixed seed.

Seed policy: when no seed is given, a 63-bit seed is drawn from the OS's
secure source (:mod:`secrets`). Whoever knows the seed can recompute (and so
remove) the noise: the seed lives only in private training checkpoints,
never in exported models, logs or reports. Philox is TensorFlow's standard
counter-based generator (as in TF Privacy); like every float Gaussian
sampler it is not hardened against floating-point side channels
(Mironov 2012).
"""

from __future__ import annotations

import secrets
from typing import Sequence

import tensorflow as tf

NOISE_DOMAIN = 0x5EED_0015  # separates this stream from the sampling streams


def new_seed() -> int:
    """A fresh secret 63-bit seed from the OS's cryptographic source."""
    return secrets.randbits(63)


def step_key(seed: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
    """The Philox key of DP step ``step``."""
    base = tf.stack([tf.cast(seed, tf.int64), tf.constant(NOISE_DOMAIN, tf.int64)])
    return tf.random.experimental.stateless_fold_in(base, tf.cast(step, tf.int64), alg="philox")


def gaussian_noise(
    shapes: Sequence[tf.TensorShape], stddev: tf.Tensor, seed: tf.Tensor, step: tf.Tensor, dtype=tf.float32
) -> list[tf.Tensor]:
    """Independent ``N(0, stddev^2)`` tensors of the given shapes for DP step ``step``."""
    key = step_key(seed, step)
    noise = []
    for k, shape in enumerate(shapes):
        sub_key = tf.random.experimental.stateless_fold_in(key, k, alg="philox")
        noise.append(tf.random.stateless_normal(shape, seed=sub_key, stddev=stddev, dtype=dtype, alg="philox"))
    return noise
