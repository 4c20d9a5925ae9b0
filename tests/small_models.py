"""Small models the tests train: an MLP 8-32-32-4 with its data, and a Conv2D + GroupNorm net (6x6x2 inputs)."""

import numpy as np
import tensorflow as tf

from sparta_tf.backend import variable_key

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def variable_name(variable) -> str:
    """A variable's unique name on either Keras line, without Keras 2's ``:0`` (``"conv1/kernel"``)."""
    return variable_key(variable).split(":")[0]


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


def conv_gn_model(seed: int = 0, classes: int = 3) -> tf.keras.Model:
    """Conv2D(4, relu) -> GroupNorm(2) -> pooling -> Dense(5, relu) -> head, on 6x6x2 inputs, seeded."""
    tf.keras.utils.set_random_seed(seed)
    layers = tf.keras.layers
    inputs = layers.Input((6, 6, 2))
    h = layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(inputs)
    h = layers.GroupNormalization(2, name="gn")(h)
    h = layers.GlobalAveragePooling2D()(h)
    h = layers.Dense(5, activation="relu", name="hidden")(h)
    return tf.keras.Model(inputs, layers.Dense(classes, name="head")(h))
