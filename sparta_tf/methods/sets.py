"""Trainable sets by parameter role: the building blocks every method's phases are made of.

Roles come from :func:`sparta_tf.groups.parameter_table`: ``kernel``
(maskable weights of Dense/Conv/Depthwise/EinsumDense), ``bias``, ``norm``
(scale/offset of GroupNorm/LayerNorm), ``head`` (the classifier) and
``other`` (embeddings, positional parameters; frozen except by ``all``).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from sparta_tf import trainable
from sparta_tf.backend import variable_key
from sparta_tf.groups import parameter_table
from sparta_tf.keras_layers import all_layers
from sparta_tf.trainable import TrainableSet, VariableSelection

ALWAYS_TRAINABLE = ("bias", "norm", "head")
"""SPARTA's warm-up set and what every sparse method trains besides its mask (DP-BitFit)."""


def dense_selections(
    model: tf.keras.Model, roles: Sequence[str], head=None, head_learning_rate_scale: float = 1.0
) -> list[VariableSelection]:
    """Whole variables of the given roles, the head's with its learning-rate scale."""
    return [
        trainable.dense(p.variable, head_learning_rate_scale if p.role == "head" else 1.0)
        for p in parameter_table(model, head)
        if p.role in roles
    ]


def role_set(model: tf.keras.Model, roles: Sequence[str], mask: Sequence[VariableSelection] = (), head=None,
             head_learning_rate_scale: float = 1.0) -> TrainableSet:
    """Whole variables of ``roles`` plus the kernel selections of ``mask``."""
    return TrainableSet(dense_selections(model, roles, head, head_learning_rate_scale) + list(mask))


def warmup_set(model: tf.keras.Model, head=None, head_learning_rate_scale: float = 1.0) -> TrainableSet:
    """The warm-up (DP-BitFit) set: biases + norms + head."""
    return role_set(model, ALWAYS_TRAINABLE, (), head, head_learning_rate_scale)


def bias_terms_set(model: tf.keras.Model, head=None, learning_rate_scale: float = 1.0) -> TrainableSet:
    """DP-BiTFiT's trainable set: every bias term (layer biases and normalisation offsets).

    The head's kernel and the normalisation scales are frozen, as in the
    DP-BiTFiT paper's two-phase ``X+BiTFiT`` (its Appendix E.3 trains no
    last-layer weights in the bias phase).
    """
    selections = []
    for p in parameter_table(model, head):
        is_offset = p.role == "norm" and p.variable is getattr(_layer_of(model, p.layer), "beta", None)
        is_bias = p.role in ("bias", "head") and variable_key(p.variable).split(":")[0].endswith("bias")
        if is_bias or is_offset:
            selections.append(trainable.dense(p.variable, learning_rate_scale))
    return TrainableSet(selections)


def _layer_of(model: tf.keras.Model, name: str):
    for layer in all_layers(model):
        if layer.name == name:
            return layer
    return None
