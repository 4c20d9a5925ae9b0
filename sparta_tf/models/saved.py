"""A saved Keras model as a ``model:`` entry (:data:`SAVED`): the model at ``path`` (``.keras``,
``.h5`` or a Keras SavedModel directory), with a fresh ``num_classes`` head by default
(:func:`~sparta_tf.models.convert.with_fresh_head`; ``fresh_head: false`` keeps its classifier,
whose output must then have ``num_classes`` units), its BatchNorm converted first when
``batchnorm`` (``groupnorm``/``freeze``) is given."""

from __future__ import annotations

import os

import tensorflow as tf

from sparta_tf.models.convert import BATCHNORM_MODES, load_keras_model, replace_batchnorm, with_fresh_head
from sparta_tf.models.entries import ModelEntry

__all__ = ["SAVED"]


def _build_saved(kwargs: dict, num_classes: int, input_shape: tuple) -> tf.keras.Model:
    mode = kwargs.get("batchnorm")
    if mode is not None and mode not in BATCHNORM_MODES:
        raise ValueError(f"model.batchnorm={mode!r} is not one of {list(BATCHNORM_MODES)}")
    model = load_keras_model(kwargs["path"])
    loaded_shape = tuple(model.input_shape[1:]) if not isinstance(model.input_shape, list) else None
    if loaded_shape is None:
        raise ValueError(f"model.path={kwargs['path']!r}: the saved model has several inputs")
    if input_shape is not None and any(
        a is not None and a != b for a, b in zip(loaded_shape, tuple(input_shape))
    ):
        raise ValueError(
            f"model.path={kwargs['path']!r} takes inputs {list(loaded_shape)}, the data has {list(input_shape)}"
        )
    if kwargs.get("fresh_head", True):
        return with_fresh_head(model, num_classes, batchnorm=mode)
    if mode is not None:
        model = replace_batchnorm(model, mode)
    units = model.output_shape[-1]
    if units != num_classes:
        raise ValueError(
            f"model.fresh_head=false but the saved model has {units} outputs for {num_classes} classes"
        )
    return model


def _check_saved(kwargs: dict) -> None:
    path = kwargs["path"]
    if not isinstance(path, str) or not os.path.exists(path):
        raise ValueError(f"model.path={path!r} does not exist; point it at a .keras/.h5 file or a SavedModel dir")


SAVED = ModelEntry(
    _build_saved, ("path", "fresh_head", "batchnorm"), required=("path",),
    description="a saved Keras model, with a fresh head by default", check=_check_saved,
)
