"""Exporting a trained model as a TensorFlow-Serving SavedModel.

:func:`export_for_serving` writes ``export_dir/<version>/``, the layout TF
Serving watches (``saved_model.pb`` + ``variables/``), with one signature::

    serving_default(images: float32 [None, H, W, C])
        -> probabilities: float32 [None, num_classes]   softmax(logits)
           classes:       int64   [None]                argmax (include_classes=True)

``images`` are in the scale the *training data* had when it entered the
model (e.g. ``[0, 1]`` floats). If training normalised inputs outside the
model, pass the constants, ``preprocessing={"mean": m, "std": s}`` (scalars
or one value per channel; both required and finite, ``s > 0``): a Keras
``Normalization`` layer computing ``(images - m) / s`` is then baked in
front of the model. ``preprocessing=None`` (the default) serves the model
on the images as given.

What is served is rebuilt, not the training object:

* a :class:`~sparta_tf.DPModel` is unwrapped to its ``.model`` (its DP
  state -- step counter, noise seed, ledger, optimizer -- is not exported);
* the Keras model is rebuilt from its config (``tf.keras.models.clone_model``:
  fresh layers from each layer's ``get_config``) and given the trained
  weights, so the per-example-gradient hooks that
  :mod:`sparta_tf.per_example` installs on layer *instances* are not part of
  the exported object (they are inert outside a recording pass anyway);
* the serving graph is ``Input("images") -> [Normalization] -> model ->
  Softmax("probabilities")``, plain Keras layers, traced once into the
  signature function; the SavedModel tracks only its variables (no Keras
  metadata: load it with ``tf.saved_model.load`` or TF Serving, not
  ``tf.keras.models.load_model``; keep a ``.keras`` file for training).

Random layers' generator states (Keras 3's ``seed_generator_state``, a
``tf.random.Generator``'s ``StateVar``) count the forward passes that training
ran: one per micro-batch, a function of the Poisson batch sizes that no ledger
charges. An exported instance carries them at zero
(:func:`~sparta_tf.random_layer_state.data_independent_random_state`); serving never draws from them.

Writes are atomic: the SavedModel is written to a hidden temporary directory
inside ``export_dir`` and renamed to the version directory, so a server
polling ``export_dir`` never sees a half-written version.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from typing import Mapping, Optional

import numpy as np
import tensorflow as tf

from sparta_tf.backend import tf_variable
from sparta_tf.random_layer_state import data_independent_random_state

__all__ = ["export_for_serving", "next_version", "SERVING_INPUT", "SERVING_OUTPUT"]

logger = logging.getLogger(__name__)

SERVING_INPUT = "images"
SERVING_OUTPUT = "probabilities"
SERVING_CLASSES = "classes"
_PREPROCESSING_KEYS = ("mean", "std")


def _unwrap(model) -> tf.keras.Model:
    from sparta_tf.dp_model import DPModel  # late: dp_model imports the whole engine

    if isinstance(model, DPModel):
        model = model.model
    if not isinstance(model, tf.keras.Model):
        raise TypeError(f"export_for_serving: expected a Keras model or a DPModel, got {type(model).__name__}")
    return model


def _clean_copy(model: tf.keras.Model) -> tf.keras.Model:
    """A model rebuilt from ``model``'s config, holding copies of its weights."""
    try:
        clean = tf.keras.models.clone_model(model)
    except (NotImplementedError, ValueError, TypeError) as error:
        logger.warning(
            "export_for_serving: %s cannot be rebuilt from its config (%s); exporting the "
            "instance itself (its per-example hooks are inert outside training)",
            type(model).__name__, error,
        )
        return model
    if not clean.built:
        clean.build(model.input_shape)
    weights = model.get_weights()
    if len(weights) != len(clean.weights):
        raise ValueError(
            f"rebuilt {model.name!r} has {len(clean.weights)} weights, the trained model {len(weights)}"
        )
    clean.set_weights(weights)
    return clean


def _image_shape(model: tf.keras.Model) -> tuple:
    shape = model.input_shape
    if isinstance(shape, list):
        if len(shape) != 1:
            raise ValueError(f"export_for_serving: the model has {len(shape)} inputs; one image input is needed")
        shape = shape[0]
    return tuple(shape[1:])


def _normalization(preprocessing: Optional[Mapping], channels: int) -> Optional[tf.keras.layers.Layer]:
    """``Normalization((x - mean) / std)`` from ``{"mean": m, "std": s}``, or None without preprocessing.

    Both values are required and must be finite (``std > 0``), one scalar or
    one value per channel: a missing or NaN statistic would bake a layer that
    serves NaN for every input. Pass ``preprocessing=None`` when the training
    data was not normalised.
    """
    if preprocessing is None or preprocessing == {}:
        return None
    if not isinstance(preprocessing, Mapping):
        raise TypeError(f"preprocessing must be a mapping {{'mean': m, 'std': s}} or None, "
                        f"got {type(preprocessing).__name__}")
    unknown = sorted(set(preprocessing) - set(_PREPROCESSING_KEYS))
    if unknown:
        raise ValueError(f"preprocessing.{unknown[0]} is not supported; valid keys: {list(_PREPROCESSING_KEYS)}")
    mean, std = (_statistic(preprocessing, key, channels) for key in _PREPROCESSING_KEYS)
    if np.any(std <= 0):
        raise ValueError(f"preprocessing.std must be > 0, got {std.tolist()}")
    return tf.keras.layers.Normalization(
        axis=-1, mean=mean.tolist(), variance=(std**2).tolist(), name="normalize"
    )


def _statistic(preprocessing: Mapping, key: str, channels: int) -> np.ndarray:
    """``preprocessing[key]`` as finite float32 ``[channels]``, or a ValueError naming the fix."""
    value = preprocessing.get(key)
    if value is None:
        raise ValueError(
            f"preprocessing.{key} is missing; give both mean and std of the training inputs, "
            "or preprocessing=None when the data was not normalised"
        )
    try:
        array = np.asarray(value, np.float32).reshape(-1)
    except (TypeError, ValueError):
        array = np.zeros(0, np.float32)
    if array.size == 1:
        array = np.full(channels, array[0], np.float32)
    if array.size != channels:
        raise ValueError(f"preprocessing.{key}={value!r} must be a number or {channels} numbers (one per channel)")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"preprocessing.{key}={array.tolist()} is not finite; pass the finite statistics "
                         "the training inputs were normalised with")
    return array


def _serving_model(clean: tf.keras.Model, preprocessing) -> tf.keras.Model:
    shape = _image_shape(clean)
    images = tf.keras.Input(shape=shape, dtype=tf.float32, name=SERVING_INPUT)
    x = images
    normalize = _normalization(preprocessing, shape[-1])
    if normalize is not None:
        x = normalize(x)
    logits = clean(x, training=False)
    logits = tf.keras.layers.Activation("linear", dtype=tf.float32, name="logits")(logits)
    probabilities = tf.keras.layers.Softmax(name=SERVING_OUTPUT)(logits)
    return tf.keras.Model(images, probabilities, name=f"{clean.name}_serving")


def next_version(export_dir: str) -> int:
    """1 + the largest integer-named subdirectory of ``export_dir`` (1 if none)."""
    if not os.path.isdir(export_dir):
        return 1
    versions = [int(n) for n in os.listdir(export_dir) if re.fullmatch(r"\d+", n)]
    return max(versions, default=0) + 1


class _ServingModule(tf.Module):
    def __init__(self, serving: tf.keras.Model, include_classes: bool):
        super().__init__(name="serving")
        # Track the variables only (the Keras model is closed over, not an
        # attribute), so the SavedModel holds the weights and the signature
        # function, nothing else.
        # The tf.Variables themselves (tf_variable: a Keras 3 variable wraps one), so that the
        # SavedModel maps the handles the signature captured to saved variables: TF1-style loaders
        # (saved_model_cli run, TF Serving's session) restore only those.
        self.model_variables = [tf_variable(v) for v in serving.variables]
        shape = (None,) + _image_shape(serving)

        @tf.function(input_signature=[tf.TensorSpec(shape, tf.float32, name=SERVING_INPUT)])
        def serve(images):
            probabilities = serving(images, training=False)
            outputs = {SERVING_OUTPUT: probabilities}
            if include_classes:
                outputs[SERVING_CLASSES] = tf.argmax(probabilities, axis=-1)
            return outputs

        self.serve = serve


def export_for_serving(
    model: tf.keras.Model,
    export_dir: str,
    version: int | None = None,
    preprocessing: dict | None = None,
    *,
    include_classes: bool = True,
) -> str:
    """Writes ``model`` as a SavedModel for TF Serving; returns the version directory.

    Args:
      model: a trained Keras model returning logits, or a
        :class:`~sparta_tf.DPModel` (its ``.model`` is exported).
      export_dir: the model's base directory (created if needed); the
        SavedModel goes to ``export_dir/<version>/``.
      version: a non-negative integer; ``None``: one more than the largest
        existing version (1 for an empty directory). An existing version is
        never overwritten (``FileExistsError``).
      preprocessing: optional ``{"mean": m, "std": s}`` (scalars or one value
        per channel) baked in as ``(images - m) / s`` before the model.
      include_classes: also output ``classes``, the argmax class index.

    Returns:
      The path of the new version directory.
    """
    if version is not None and (not isinstance(version, (int, np.integer)) or version < 0):
        raise ValueError(f"version must be a non-negative integer, got {version!r}")
    clean = _clean_copy(_unwrap(model))
    serving = _serving_model(clean, preprocessing)
    module = _ServingModule(serving, include_classes)

    export_dir = os.fspath(export_dir)
    os.makedirs(export_dir, exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=".tmp-export-", dir=export_dir)
    try:
        with data_independent_random_state(serving):
            tf.saved_model.save(module, temporary, signatures={"serving_default": module.serve})
        auto = version is None
        number = next_version(export_dir) if auto else int(version)
        while True:
            target = os.path.join(export_dir, str(number))
            if os.path.exists(target):
                if not auto:
                    raise FileExistsError(f"export version {target!r} already exists; pick another version")
                number += 1
                continue
            try:
                os.rename(temporary, target)
            except OSError:
                if auto and os.path.exists(target):  # another writer took this number
                    number += 1
                    continue
                raise
            return target
    finally:
        if os.path.exists(temporary):
            shutil.rmtree(temporary, ignore_errors=True)
