"""The small classifier and data the method-level tests train: an MLP 8-32-32-4 with a "head" layer."""

import numpy as np
import tensorflow as tf

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def small_mlp() -> tf.keras.Model:
    """Dense(32, relu) x2 and a 4-way head named "head", seeded weights."""
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([
        tf.keras.Input((8,)),
        tf.keras.layers.Dense(32, activation="relu", name="d1"),
        tf.keras.layers.Dense(32, activation="relu", name="d2"),
        tf.keras.layers.Dense(4, name="head"),
    ])


def small_data(n: int):
    """``n`` Gaussian 8-feature examples and labels in 0..3, seeded."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 4, n)
