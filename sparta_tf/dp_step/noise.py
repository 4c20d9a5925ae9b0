"""The Gaussian noise of a DP-SGD step.

For the summed clipped gradient ``S_t`` (sensitivity ``C``) and noise multiplier ``sigma``::

    S~_t = S_t + N(0, sigma^2 C^2 I)

drawn by :func:`sparta_tf.noise.gaussian_noise` from the run's noise seed, the
``"dp_sgd_noise"`` stream and the global DP step ``t`` (so every replica draws the same noise,
and a resumed run the noise an uninterrupted one would have drawn), in the dtype of each sum
(float32; float64 for a float64 model), before any cast to a variable's dtype.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.noise import gaussian_noise


class GaussianNoise:
    """``S -> S + N(0, sigma^2 C^2 I)`` at step ``t`` (see the module doc)."""

    def __init__(self, noise_multiplier: float, clip_norm: float, seed: tf.Variable | tf.Tensor):
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.seed = seed

    def __call__(self, sums: list, step: tf.Tensor) -> list:
        std = self.noise_multiplier * self.clip_norm
        noise = gaussian_noise([s.shape for s in sums], std, self.seed, step, dtype=[s.dtype for s in sums])
        return [s + z for s, z in zip(sums, noise)]
