"""Random layers' generator states: counters of the draws a model made, which an export must not carry.

A Keras 3 random layer (``Dropout``, ``GaussianNoise``, ``Random*``) keeps a ``SeedGenerator`` whose
``seed_generator_state`` counts its draws; a ``tf.random.Generator`` keeps a ``StateVar``. Trained under
DP-SGD with micro-batches they count one draw per micro-batch of every step, about ``sum_t |B_t| / P``:
a count of private data that no ledger charges.
"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

__all__ = ["RANDOM_STATE_NAMES", "random_states", "data_independent_random_state"]

RANDOM_STATE_NAMES = ("seed_generator_state", "StateVar")
"""Names of the variables in which random layers count their draws (Keras 3's ``SeedGenerator``,
``tf.random.Generator``)."""


def random_states(model: tf.keras.Model) -> list:
    """The integer variables of ``model`` named as a random generator's state (:data:`RANDOM_STATE_NAMES`)."""
    return [v for v in model.variables
            if v.name.split("/")[-1].split(":")[0] in RANDOM_STATE_NAMES and not tf.as_dtype(v.dtype).is_floating]


@contextlib.contextmanager
def data_independent_random_state(model: tf.keras.Model):
    """Within the block, every random generator state of ``model`` reads zero; the values are put back
    after. A state counts its draws (e.g. one per micro-batch of every DP step, so about ``sum_t |B_t| /
    P``): a count of private data that an export of the trained instance would otherwise write."""
    states = random_states(model)
    values = [v.numpy() for v in states]
    try:
        for variable, value in zip(states, values):
            variable.assign(np.zeros_like(value))
        yield
    finally:
        for variable, value in zip(states, values):
            variable.assign(value)
