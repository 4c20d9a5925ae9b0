"""Making third-party Keras models usable for per-example DP training.

BatchNormalization in training mode normalises every example with the
statistics of its batch, so per-example gradients (and the DP guarantee of
DP-SGD) are ill defined; :class:`~sparta_tf.DPModel` refuses such models
(:func:`sparta_tf.model_checks.reject_batchnorm_in_training_mode`). Two fixes:

* :func:`replace_batchnorm` ``mode="groupnorm"`` rebuilds a functional (or
  Sequential) model with each BatchNormalization replaced by a fresh
  ``GroupNormalization(groups=gcd(32, C))`` -- Opacus' ``ModuleValidator.fix``
  rule -- over the same channel axis, with the same epsilon/center/scale. Every
  other layer keeps its weights; the GroupNorm scale/offset start at 1/0 (the
  BatchNorm affine parameters are not copied: they were fitted to batch
  statistics, which GroupNorm does not reproduce). Nested functional models
  (e.g. a keras-cv backbone inside a classifier) are converted recursively.
* ``mode="freeze"`` sets ``trainable = False`` on every BatchNormalization,
  which in Keras 2 also runs it in inference mode: ``y = gamma (x - mu) /
  sqrt(var + eps) + beta`` with the *stored* moving statistics, an affine
  per-channel map, so per-example. Use it for pretrained backbones whose
  statistics are meaningful; the model is modified in place and returned
  (recompile it if it was compiled).

:func:`with_fresh_head` loads a saved Keras model (or takes one) and swaps its
classifier for a new ``Dense(num_classes, name="head")``, the convention of
every model in :mod:`sparta_tf.models`.
"""

from __future__ import annotations

import importlib
import math
import os
import zipfile
from typing import Optional, Union

import tensorflow as tf

from sparta_tf.backend import KERAS3
from sparta_tf.keras_layers import all_layers
from sparta_tf.model_checks import is_batch_normalization
from sparta_tf.models.resnet import HEAD_LAYER_NAME

__all__ = ["BATCHNORM_MODES", "replace_batchnorm", "with_fresh_head", "load_keras_model"]

BATCHNORM_MODES = ("groupnorm", "freeze")



def _is_graph_model(layer) -> bool:
    """A functional or Sequential model (one whose graph of layers can be rebuilt).

    Keras 2 marks functional models with ``_is_graph_network``; Keras 3 has no such flag, its
    functional models are instances of ``Functional`` (``keras.src.models.functional``)."""
    if not isinstance(layer, tf.keras.Model):
        return False
    if isinstance(layer, tf.keras.Sequential):
        return True
    if KERAS3:
        return any(cls.__name__ == "Functional" for cls in type(layer).__mro__)
    return bool(getattr(layer, "_is_graph_network", False))


def _input_shape(layer):
    """The input shape of ``layer``'s first call (Keras 2: ``layer.input_shape``, a list when called on
    several inputs; Keras 3 has no ``input_shape`` on layers: the shape of ``layer.input``)."""
    if not KERAS3:
        return layer.input_shape
    features = layer.input
    if isinstance(features, (list, tuple)):
        return [tuple(t.shape) for t in features]
    return tuple(features.shape)


def _inbound_layer(node):
    """The layer (or list of layers) feeding a call ``node``: ``inbound_layers`` on Keras 2; Keras 3
    nodes name their parent nodes, whose ``operation`` is the layer."""
    if not KERAS3:
        return node.inbound_layers
    layers = [parent.operation for parent in node.parent_nodes]
    return layers[0] if len(layers) == 1 else layers


def _rank(tensor) -> int:
    """Rank of a symbolic tensor (a ``TensorShape`` on Keras 2, a tuple on Keras 3)."""
    return len(tensor.shape)


def _bn_axis(layer: tf.keras.layers.Layer) -> int:
    axis = layer.axis
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            raise ValueError(
                f"BatchNormalization {layer.name!r} normalises over axes {list(axis)}; "
                "only a single channel axis can become a GroupNormalization"
            )
        axis = axis[0]
    return int(axis)


def _group_norm_for(layer: tf.keras.layers.Layer) -> tf.keras.layers.GroupNormalization:
    axis = _bn_axis(layer)
    shape = _input_shape(layer) if layer._inbound_nodes else None
    if isinstance(shape, list):  # a layer called more than once: all calls share C
        shape = shape[0]
    channels = shape[axis] if shape is not None else None
    if channels is None and layer.built:
        channels = int(layer.gamma.shape[0]) if layer.scale else int(layer.moving_mean.shape[0])
    if channels is None:
        raise ValueError(f"cannot tell the channel count of BatchNormalization {layer.name!r}")
    return tf.keras.layers.GroupNormalization(
        groups=math.gcd(32, int(channels)),
        axis=axis,
        epsilon=layer.epsilon,
        center=layer.center,
        scale=layer.scale,
        name=layer.name,
    )


def _clone_plain(layer):
    return layer.__class__.from_config(layer.get_config())


def _call_dropping_unused_mask(layer, *args, **kwargs):
    """Calls a cloned layer as the original was called, less a ``mask=None`` its ``call`` cannot take
    (Keras 3 records BatchNormalization's ``mask=None``; GroupNormalization's ``call`` has no ``mask``)."""
    if "mask" in kwargs and kwargs["mask"] is None and isinstance(layer, tf.keras.layers.GroupNormalization):
        kwargs.pop("mask")
    return layer(*args, **kwargs)


def _clone_model(model: tf.keras.Model, clone_function) -> tf.keras.Model:
    """``clone_model`` with ``clone_function``; on Keras 3 also the call hook that replays each layer's
    recorded call arguments (see :func:`_call_dropping_unused_mask`), for functional models: a
    Sequential model records no call arguments, and Keras 3 refuses the hook for one."""
    if KERAS3 and not isinstance(model, tf.keras.Sequential):
        return tf.keras.models.clone_model(model, clone_function=clone_function,
                                           call_function=_call_dropping_unused_mask)
    return tf.keras.models.clone_model(model, clone_function=clone_function)


def _to_groupnorm(model: tf.keras.Model) -> tf.keras.Model:
    if not _is_graph_model(model):
        raise ValueError(
            f"replace_batchnorm(mode='groupnorm') needs a functional or Sequential model, "
            f"got the subclassed {type(model).__name__!r}; use mode='freeze' or build it with GroupNorm"
        )
    converted_nested = {}

    def clone_function(layer):
        if is_batch_normalization(layer):
            return _group_norm_for(layer)
        if _is_graph_model(layer):
            new = _to_groupnorm(layer)
            converted_nested[id(new)] = layer
            return new
        if isinstance(layer, tf.keras.Model):
            raise ValueError(
                f"nested subclassed model {layer.name!r} cannot be rebuilt; use mode='freeze'"
            )
        return _clone_plain(layer)

    new_model = _clone_model(model, clone_function)
    old_by_name = {layer.name: layer for layer in model.layers}
    for new_layer in new_model.layers:
        old = old_by_name.get(new_layer.name)
        if old is None or is_batch_normalization(old) or id(new_layer) in converted_nested:
            continue
        weights = old.get_weights()
        if weights:
            new_layer.set_weights(weights)
        new_layer.trainable = old.trainable
    return new_model


def replace_batchnorm(model: tf.keras.Model, mode: str = "groupnorm") -> tf.keras.Model:
    """Makes ``model`` per-example safe by converting or freezing its BatchNorm layers.

    Args:
      model: a Keras model, e.g. a keras-cv (Keras 2) or keras-hub (Keras 3)
        backbone built from explicit constructor arguments. ``"groupnorm"`` needs a functional or
        Sequential model (nested ones are converted too); ``"freeze"`` works
        on any model.
      mode: ``"groupnorm"`` -- a new model where each BatchNormalization
        becomes ``GroupNormalization(groups=gcd(32, C))`` (same name, axis,
        epsilon, center/scale; fresh scale 1 / offset 0) and every other layer
        keeps its weights; the result is a plain functional ``tf.keras.Model``
        (e.g. no longer a keras-cv ``Backbone`` instance). ``"freeze"`` -- the
        same ``model`` with every BatchNormalization set to
        ``trainable=False`` (inference mode, moving statistics, on both Keras lines).

    Returns:
      The converted model (a new one for ``"groupnorm"``, ``model`` itself
      for ``"freeze"``). A model without BatchNorm is returned unchanged
      (``"freeze"``) or cloned with its weights (``"groupnorm"``).
    """
    if mode not in BATCHNORM_MODES:
        raise ValueError(f"replace_batchnorm: mode={mode!r} is not one of {BATCHNORM_MODES}")
    if mode == "freeze":
        for layer in all_layers(model):
            if is_batch_normalization(layer):
                layer.trainable = False
        return model
    return _to_groupnorm(model)


def load_keras_model(path: Union[str, os.PathLike]) -> tf.keras.Model:
    """Loads a ``.keras`` file, an ``.h5`` file or a Keras SavedModel directory (no compile)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no saved model at {path!r} (expected a .keras/.h5 file or a SavedModel dir)")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "saved_model.pb")):
        raise ValueError(f"{path!r} is a directory without saved_model.pb, not a SavedModel")
    if os.path.isdir(path) and KERAS3:
        raise ValueError(f"{path!r} is a SavedModel directory, which Keras 3 cannot load as a Keras model; "
                         "save the model as a .keras file (model.save('model.keras')) and point at that")
    _register_classes_of(path)
    try:
        return tf.keras.models.load_model(path, compile=False)
    except (ValueError, OSError, KeyError) as error:  # e.g. a non-Keras SavedModel
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"cannot load a Keras model from {path!r}: {first}") from error


_REGISTERING_PACKAGES = ("keras_hub",)
"""Packages whose layers and models a ``.keras`` file may name; importing one registers its classes."""


def _register_classes_of(path: str) -> None:
    """Imports the packages (:data:`_REGISTERING_PACKAGES`) whose classes the ``.keras`` file at ``path``
    names, so that loading it finds them (a keras-hub backbone saved with ``model.save``). A package
    that is not installed is a one-line ValueError naming it."""
    if not (path.endswith(".keras") and zipfile.is_zipfile(path)):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            config = archive.read("config.json").decode("utf-8", errors="replace")
    except (KeyError, OSError, zipfile.BadZipFile):
        return  # not a Keras archive: load_model says so
    for package in _REGISTERING_PACKAGES:
        if f'"module": "{package}' in config:
            try:
                importlib.import_module(package)
            except ImportError as error:
                raise ValueError(f"{path!r} holds {package} classes; pip install {package.replace('_', '-')} to "
                                 "load it") from error


def _trainable_batchnorm(model: tf.keras.Model) -> Optional[str]:
    for layer in all_layers(model):
        if is_batch_normalization(layer) and layer.trainable:
            return layer.name
    return None


def _single_input(layer) -> tf.Tensor:
    if len(layer._inbound_nodes) != 1:
        raise ValueError(
            f"layer {layer.name!r} is called {len(layer._inbound_nodes)} times; cannot tell its features"
        )
    features = layer.input
    if isinstance(features, (list, tuple)):
        raise ValueError(f"layer {layer.name!r} has several inputs; cannot use them as features")
    return features


def _penultimate_features(model: tf.keras.Model) -> tf.Tensor:
    """The classifier's input: that of layer "head", else of the last (Dense) layer."""
    names = [layer.name for layer in model.layers]
    if HEAD_LAYER_NAME in names:
        return _single_input(model.get_layer(HEAD_LAYER_NAME))
    last = model.layers[-1]
    if not last.weights and len(model.layers) >= 2:
        # A weightless output layer (Softmax / Activation) after the classifier.
        previous = _inbound_layer(last._inbound_nodes[0]) if len(last._inbound_nodes) == 1 else None
        if isinstance(previous, (tf.keras.layers.Dense, tf.keras.layers.EinsumDense)):
            return _single_input(previous)
    if isinstance(last, (tf.keras.layers.Dense, tf.keras.layers.EinsumDense)):
        return _single_input(last)
    # No classifier: the model is a feature extractor; its output is the feature.
    outputs = model.outputs
    if len(outputs) != 1:
        raise ValueError(f"model {model.name!r} has {len(outputs)} outputs; cannot tell its features")
    return outputs[0]


def with_fresh_head(
    model_or_path: Union[tf.keras.Model, str, os.PathLike],
    num_classes: int,
    *,
    batchnorm: Optional[str] = None,
) -> tf.keras.Model:
    """A model with the penultimate features of ``model_or_path`` and a new ``Dense`` head.

    Args:
      model_or_path: a functional/Sequential Keras model or the path of one
        (``.keras`` file, ``.h5`` file or Keras SavedModel directory).
      num_classes: outputs of the new head ``Dense(num_classes, name="head")``
        (logits, default Keras initialisation).
      batchnorm: ``None`` (default): a trainable BatchNormalization anywhere
        raises ``ValueError``; ``"groupnorm"`` / ``"freeze"``: converted first
        with :func:`replace_batchnorm`.

    Features are the input of the layer named ``"head"``; without one, the
    input of the last layer when it is a Dense/EinsumDense classifier (or of
    the Dense before a final weightless Softmax/Activation layer); otherwise
    the model's output itself (a feature extractor). Features of rank 3/4
    (tokens / feature maps) are global-average-pooled (layer
    ``"fresh_head_pool"``). The old head and anything after it are dropped;
    every other layer, with its weights, is shared with the loaded model.
    """
    if isinstance(model_or_path, (str, os.PathLike)):
        model = load_keras_model(model_or_path)
    elif isinstance(model_or_path, tf.keras.Model):
        model = model_or_path
    else:
        raise TypeError(f"with_fresh_head: expected a Keras model or a path, got {type(model_or_path).__name__}")
    if batchnorm is not None:
        model = replace_batchnorm(model, batchnorm)
    bn = _trainable_batchnorm(model)
    if bn is not None:
        raise ValueError(
            f"model {model.name!r} has BatchNormalization {bn!r} in training mode, which breaks per-example DP; "
            "pass batchnorm='groupnorm' or 'freeze' (sparta_tf.models.replace_batchnorm)"
        )
    if not _is_graph_model(model):
        raise ValueError(f"with_fresh_head needs a functional or Sequential model, got {type(model).__name__!r}")
    features = _penultimate_features(model)
    rank = _rank(features)
    if rank == 4:
        features = tf.keras.layers.GlobalAveragePooling2D(name="fresh_head_pool")(features)
    elif rank == 3:
        features = tf.keras.layers.GlobalAveragePooling1D(name="fresh_head_pool")(features)
    elif rank != 2:
        raise ValueError(f"penultimate features of rank {rank} cannot feed a Dense head")
    logits = tf.keras.layers.Dense(num_classes, name=HEAD_LAYER_NAME)(features)
    return tf.keras.Model(model.inputs, logits, name=model.name)
