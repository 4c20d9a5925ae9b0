"""Image backbones of the keras-cv and keras-hub libraries as ``model:`` entries (:data:`KERAS_CV`,
:data:`KERAS_HUB`): a backbone *class* built from explicit arguments (never a preset: presets
download weights), its BatchNorm handled by ``batchnorm`` (``groupnorm``, the default, or
``freeze``; :func:`~sparta_tf.models.convert.replace_batchnorm`), then global average pooling
(layer ``"pool"``) and ``Dense(num_classes, name="head")``.

keras-cv 0.9 builds Keras 2 models (the TF 2.15 line), keras-hub 0.32 Keras 3 models (the TF 2.21
line); on the other line each is a one-line error naming the fix.
"""

from __future__ import annotations

import os
from typing import Mapping

import tensorflow as tf

from sparta_tf.models.convert import BATCHNORM_MODES, replace_batchnorm
from sparta_tf.models.entries import ModelEntry
from sparta_tf.models.resnet import HEAD_LAYER_NAME

__all__ = ["KERAS_CV", "KERAS_HUB", "keras_cv_backbone_names", "keras_hub_backbone_names"]


# ----------------------------------------------------------------- keras-cv


def _keras_cv_models():
    from sparta_tf.backend import keras_version

    if not keras_version().startswith("2.15"):
        raise ValueError(f"model.name=keras_cv needs keras-cv 0.9 on Keras 2.15 (the TF 2.15 line, Python 3.11); "
                         f"this is Keras {keras_version()}, where keras-cv builds Keras 3 models: use a zoo model "
                         "(resnet20_gn, vit_tiny, ...) or `model: saved`")
    try:
        import keras_cv  # noqa: F401  (slow import, only when asked for)
    except ImportError as error:
        raise ValueError("model.name=keras_cv needs the keras-cv package (pip install keras-cv==0.9.0)") from error
    return keras_cv.models


def keras_cv_backbone_names() -> list[str]:
    """keras-cv backbone classes buildable from explicit arguments (preset aliases excluded)."""
    models = _keras_cv_models()
    base = models.Backbone
    names = []
    for name in dir(models):
        cls = getattr(models, name)
        if not (isinstance(cls, type) and issubclass(cls, base) and cls is not base):
            continue
        # Preset aliases (ResNet50V2Backbone, ...) construct through __new__ + from_preset,
        # which downloads the preset's config: never used here.
        if "__new__" in vars(cls):
            continue
        names.append(name)
    return sorted(names)


def _build_keras_cv(kwargs: dict, num_classes: int, input_shape: tuple) -> tf.keras.Model:
    models = _keras_cv_models()
    name = kwargs["backbone"]
    valid = keras_cv_backbone_names()
    if name not in valid:
        raise ValueError(f"model.backbone={name!r} is not a keras-cv backbone class; valid choices: {valid}")
    args = dict(kwargs.get("backbone_args") or {})
    for forbidden in ("weights", "input_tensor"):
        if forbidden in args:
            raise ValueError(f"model.backbone_args.{forbidden} is not supported (no downloads, image input only)")
    given_shape = args.pop("input_shape", None)
    if given_shape is not None and tuple(given_shape) != tuple(input_shape):
        raise ValueError(
            f"model.backbone_args.input_shape={list(given_shape)} disagrees with the data's {list(input_shape)}"
        )
    args.setdefault("include_rescaling", False)
    try:
        backbone = getattr(models, name)(input_shape=tuple(input_shape), **args)
    except TypeError as error:
        raise ValueError(f"model.backbone_args do not fit {name}: {error}") from error
    mode = _batchnorm_mode(kwargs)
    return _classifier(replace_batchnorm(backbone, mode), num_classes, f"keras_cv_{name}")


def _batchnorm_mode(kwargs: dict) -> str:
    mode = kwargs.get("batchnorm", "groupnorm")
    if mode not in BATCHNORM_MODES:
        raise ValueError(f"model.batchnorm={mode!r} is not one of {list(BATCHNORM_MODES)}")
    return mode


def _classifier(backbone: tf.keras.Model, num_classes: int, name: str) -> tf.keras.Model:
    """``backbone`` + global average pooling (layer ``"pool"``, for feature maps or tokens) +
    ``Dense(num_classes, name="head")``."""
    x = backbone.output
    if len(x.shape) == 4:
        x = tf.keras.layers.GlobalAveragePooling2D(name="pool")(x)
    elif len(x.shape) == 3:
        x = tf.keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = tf.keras.layers.Dense(num_classes, name=HEAD_LAYER_NAME)(x)
    return tf.keras.Model(backbone.inputs, outputs, name=name)


# ---------------------------------------------------------------- keras-hub


def _keras_hub_models():
    """``keras_hub.models``, or a one-line ValueError naming the fix (Keras 2, or keras-hub missing)."""
    from sparta_tf.backend import KERAS3, keras_version

    if not KERAS3:
        raise ValueError(f"model.name=keras_hub needs Keras 3 (keras-hub 0.32 builds Keras 3 models; the "
                         f"TF 2.21 line on Python 3.12/3.13: pip install -e .); this is Keras {keras_version()}: "
                         "use model.name=keras_cv (keras-cv 0.9) or a zoo model (resnet20_gn, vit_tiny, ...)")
    try:
        import keras_hub  # noqa: F401  (slow import, only when asked for)
    except ImportError as error:
        raise ValueError("model.name=keras_hub needs the keras-hub package (pip install keras-hub==0.32.0)") from error
    return keras_hub.models


def keras_hub_backbone_names() -> list[str]:
    """keras-hub image backbone classes: the ``backbone_cls`` of each image classifier task
    (``ResNetBackbone``, ``EfficientNetBackbone``, ``ViTBackbone``, ...), all built from explicit
    arguments here (never ``from_preset``)."""
    models = _keras_hub_models()
    names = set()
    for name in dir(models):
        task = getattr(models, name)
        if isinstance(task, type) and issubclass(task, models.ImageClassifier) and task is not models.ImageClassifier:
            backbone = getattr(task, "backbone_cls", None)
            if isinstance(backbone, type) and getattr(models, backbone.__name__, None) is backbone:
                names.add(backbone.__name__)
    return sorted(names)


def _keras_hub_backbone_args(kwargs: dict, input_shape: tuple) -> dict:
    """``backbone_args`` plus ``image_shape`` from the data; a disagreeing ``image_shape`` is an error."""
    args = dict(kwargs.get("backbone_args") or {})
    given_shape = args.pop("image_shape", None)
    if given_shape is not None and tuple(given_shape) != tuple(input_shape):
        raise ValueError(
            f"model.backbone_args.image_shape={list(given_shape)} disagrees with the data's {list(input_shape)}"
        )
    args["image_shape"] = tuple(input_shape)
    return args


def _load_backbone_weights(backbone: tf.keras.Model, path: str) -> None:
    """Loads ``path`` (a ``.weights.h5`` file of ``backbone.save_weights``) into ``backbone``, or a
    one-line ValueError saying why not."""
    try:
        backbone.load_weights(path)
    except (ValueError, OSError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"model.weights={path!r} does not fit this backbone: {first}") from error


def _build_keras_hub(kwargs: dict, num_classes: int, input_shape: tuple) -> tf.keras.Model:
    models = _keras_hub_models()
    name = kwargs["backbone"]
    _check_keras_hub(kwargs)
    mode = _batchnorm_mode(kwargs)
    args = _keras_hub_backbone_args(kwargs, input_shape)
    try:
        backbone = getattr(models, name)(**args)
    except (TypeError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"model.backbone_args do not fit {name}: {first}") from error
    if kwargs.get("weights") is not None:
        _load_backbone_weights(backbone, kwargs["weights"])
    return _classifier(replace_batchnorm(backbone, mode), num_classes, f"keras_hub_{name}")


def _check_keras_cv(kwargs: dict) -> None:
    valid = keras_cv_backbone_names()
    if kwargs["backbone"] not in valid:
        raise ValueError(f"model.backbone={kwargs['backbone']!r} is not a keras-cv backbone class; "
                         f"valid choices: {valid}")


def _check_keras_hub(kwargs: dict) -> None:
    valid = keras_hub_backbone_names()
    if kwargs["backbone"] not in valid:
        raise ValueError(f"model.backbone={kwargs['backbone']!r} is not a keras-hub image backbone class; "
                         f"valid choices: {valid}")
    args = kwargs.get("backbone_args") or {}
    if isinstance(args, Mapping) and "weights" in args:
        raise ValueError("model.backbone_args.weights is not supported; give a .weights.h5 file as model.weights")
    weights = kwargs.get("weights")
    if weights is not None:
        if not isinstance(weights, str) or not os.path.isfile(weights):
            raise ValueError(f"model.weights={weights!r} is not a file; give a .weights.h5 file written by "
                             "backbone.save_weights, or leave it out for random weights")


KERAS_CV = ModelEntry(
    _build_keras_cv, ("backbone", "backbone_args", "batchnorm"), required=("backbone",),
    description="keras-cv backbone class from explicit args + pool + head", check=_check_keras_cv,
)
KERAS_HUB = ModelEntry(
    _build_keras_hub, ("backbone", "backbone_args", "batchnorm", "weights"), required=("backbone",),
    description="keras-hub image backbone class from explicit args (Keras 3) + pool + head",
    check=_check_keras_hub,
)
