"""Checks that a Keras model admits per-example gradients (and so DP-SGD)."""

from __future__ import annotations

import tensorflow as tf


class NotPerExampleSafeError(ValueError):
    """The model mixes examples of a batch, so per-example DP does not hold."""


def _all_layers(model: tf.keras.Model):
    return model._flatten_layers(include_self=False, recursive=True)


def reject_batchnorm_in_training_mode(model: tf.keras.Model) -> None:
    """Raises :class:`NotPerExampleSafeError` for trainable BatchNormalization layers.

    In training mode BatchNorm normalises each example with the statistics of
    the whole batch, so one example's gradient depends on every other example
    and clipping per-example gradients no longer bounds any single example's
    influence: the DP guarantee would be void. Frozen BatchNorm layers
    (``layer.trainable = False``) run in inference mode with fixed moving
    statistics in Keras 2, which is per-example and allowed.
    """
    for layer in _all_layers(model):
        if isinstance(layer, tf.keras.layers.BatchNormalization) and layer.trainable:
            raise NotPerExampleSafeError(
                f"layer {layer.name!r} is BatchNormalization in training mode: it mixes the "
                "examples of a batch, which breaks per-example clipping and the DP guarantee; "
                "replace it with GroupNormalization/LayerNormalization, or freeze it "
                "(layer.trainable = False) to run it in inference mode"
            )
