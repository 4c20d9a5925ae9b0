"""Learning-rate schedules.

The SPARTA paper trains with a cosine annealing schedule and a linear
warm-up of 2% of the steps (one epoch of 50). Keras' ``CosineDecay`` has the
warm-up built in; :func:`cosine_with_warmup` only fixes its arguments::

    lr(t) = peak * t / W                                      for t < W
    lr(t) = peak * (a + (1 - a) * (1 + cos(pi (t - W) / (T - W))) / 2)   for W <= t <= T

with ``T`` the total number of steps, ``W = round(warmup_fraction * T)``
and ``a = final_fraction``.
"""

from __future__ import annotations

import tensorflow as tf


def cosine_with_warmup(
    peak_learning_rate: float,
    total_steps: int,
    warmup_fraction: float = 0.02,
    final_fraction: float = 0.0,
) -> tf.keras.optimizers.schedules.CosineDecay:
    """Linear warm-up from 0 to ``peak_learning_rate``, then cosine decay to ``final_fraction * peak``."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    if not 0 <= warmup_fraction < 1:
        raise ValueError(f"warmup_fraction={warmup_fraction} must be in [0, 1)")
    warmup_steps = int(round(warmup_fraction * total_steps))
    return tf.keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup_steps else peak_learning_rate,
        decay_steps=max(1, total_steps - warmup_steps),
        alpha=final_fraction,
        warmup_target=peak_learning_rate if warmup_steps else None,
        warmup_steps=warmup_steps,
    )
