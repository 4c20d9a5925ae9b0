"""Small models the tests train, their data, and the one-example tape gradients they are checked against.

An MLP 8-32-32-4 with its data, a Conv2D + GroupNorm net (6x6x2 inputs), seeded Gaussian inputs with
uniform labels for any input shape, and every example's gradient taken alone with ``tf.GradientTape``.
"""

import numpy as np
import tensorflow as tf

from sparta_tf.backend import variable_key

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
PER_EXAMPLE_LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def variable_name(variable) -> str:
    """A variable's unique name on either Keras line, without Keras 2's ``:0`` (``"conv1/kernel"``)."""
    return variable_key(variable).split(":")[0]


def gaussian_data(n: int, shape: tuple, classes: int, seed: int = 0):
    """``(x, y)``: ``n`` float32 inputs of ``shape`` drawn from N(0, 1), then ``n`` labels uniform in
    ``0..classes-1`` (int64), both from ``np.random.default_rng(seed)`` in that order."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, *shape)).astype(np.float32), rng.integers(0, classes, n)


def small_mlp(name: str | None = None) -> tf.keras.Model:
    """Dense(32, relu) x2 and a 4-way head named "head", seeded weights; ``name``: the model's (Keras
    auto-names it otherwise, and Keras 3 puts that name in its variables' paths, so a mask saved from one
    auto-named model does not load into the next one built in the same process)."""
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([
        tf.keras.Input((8,)),
        tf.keras.layers.Dense(32, activation="relu", name="d1"),
        tf.keras.layers.Dense(32, activation="relu", name="d2"),
        tf.keras.layers.Dense(4, name="head"),
    ], name=name)


def small_data(n: int):
    """``n`` Gaussian 8-feature examples and labels in 0..3, seeded: :func:`small_mlp`'s data."""
    return gaussian_data(n, (8,), 4)


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


def per_example_loss(y, logits):
    """Cross-entropy of each example's logits, ``[B]`` (the engines' per-example loss)."""
    return PER_EXAMPLE_LOSS(y, logits)


def tape_gradients(model, x, y) -> list[np.ndarray]:
    """Per trainable variable, ``[B, *variable.shape]``: row ``i`` is example ``i``'s gradient of
    :func:`per_example_loss` taken alone with ``tf.GradientTape`` (float32, ``training=True``)."""
    per_example = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = PER_EXAMPLE_LOSS(y[i : i + 1], model(x[i : i + 1], training=True))[0]
        per_example.append(tape.gradient(loss, model.trainable_variables))
    return [np.stack([g[k].numpy() for g in per_example]) for k in range(len(model.trainable_variables))]
