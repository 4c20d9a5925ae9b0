"""Model zoo: builds the model of a config's ``model:`` section.

The YAML section is a mapping with a ``name`` and that model's keys::

    model:
      name: wrn16_4_gn          # one of MODEL_REGISTRY
      groups: 16                # keyword arguments of the builder, passed through
      dropout_rate: 0.0

    model: {name: vit_tiny, dim: 64, depth: 4, heads: 2, mlp_dim: 128}

    model:
      name: keras_cv
      backbone: ResNetV2Backbone        # a keras_cv.models class, built from explicit args
      backbone_args: {stackwise_filters: [64, 128], stackwise_blocks: [2, 2],
                      stackwise_strides: [1, 2]}
      batchnorm: groupnorm              # or freeze

    model:
      name: keras_hub
      backbone: ResNetBackbone          # a keras_hub.models image backbone class, built from explicit args
      backbone_args: {input_conv_filters: [64], input_conv_kernel_sizes: [3],
                      stackwise_num_filters: [64, 128], stackwise_num_blocks: [2, 2],
                      stackwise_num_strides: [1, 2], block_type: basic_block}
      batchnorm: groupnorm              # or freeze
      weights: runs/backbone.weights.h5 # optional; random initialisation without it

    model: {name: saved, path: runs/pretrained.keras, fresh_head: true}

Builder keyword arguments may also be given under an ``args:`` mapping
(``{name: resnet20_gn, args: {groups: 8}}``); a key given both ways is an
error. ``num_classes`` and ``input_shape`` come from the data, never from
this section.

Names (:data:`MODEL_REGISTRY`):

* ``resnet20_gn``, ``resnet18_gn`` -- :mod:`sparta_tf.models.resnet`
  (args: ``groups``, ``width``, ``shortcut``, ``conv_bias``);
* ``wrn16_4_gn`` -- :func:`~sparta_tf.models.wrn.wrn_gn` with depth 16,
  width 4 (args: ``groups``, ``dropout_rate``, ``conv_bias``); ``wrn_gn`` --
  any depth/width;
* ``vit_tiny`` -- :func:`~sparta_tf.models.vit.vit_tiny` (args:
  ``patch_size``, ``dim``, ``depth``, ``heads``, ``mlp_dim``, ``dropout``);
* ``keras_cv`` -- a keras-cv backbone *class* (never a preset: presets
  download weights) constructed with ``backbone_args`` plus ``input_shape``
  (and ``include_rescaling=False`` unless given), BatchNorm handled by
  ``batchnorm`` (``groupnorm``, the default, or ``freeze``; see
  :func:`~sparta_tf.models.convert.replace_batchnorm`), then global average
  pooling (layer ``"pool"``) and ``Dense(num_classes, name="head")``;
* ``keras_hub`` (Keras 3 only, keras-hub 0.32) -- the same for a keras-hub image backbone class
  (:func:`keras_hub_backbone_names`: the ``backbone_cls`` of keras-hub's image classifiers), built
  with ``backbone_args`` plus ``image_shape`` from the data (never ``from_preset``: presets download
  weights); ``weights`` optionally loads the backbone's weights from a ``.weights.h5`` file written
  by ``backbone.save_weights`` (before BatchNorm is converted, so a trained BatchNorm backbone's
  other weights carry over); BatchNorm handled by ``batchnorm`` as for ``keras_cv``, then pooling
  (layer ``"pool"``) and ``Dense(num_classes, name="head")``. On Keras 2 it is a one-line error
  naming the fix, as ``keras_cv`` is on Keras 3;
* ``pretrained`` -- a public model shipped with sparta-tf, by name
  (``weights``; :mod:`sparta_tf.models.pretrained`), with a fresh head by
  default (``fresh_head: false`` keeps its public head);
* ``saved`` -- a saved Keras model at ``path`` (``.keras``, ``.h5`` or Keras
  SavedModel dir); ``fresh_head`` (default true) replaces its classifier by a
  new ``num_classes`` head (:func:`~sparta_tf.models.convert.with_fresh_head`),
  ``fresh_head: false`` keeps it (its output must have ``num_classes``
  units); ``batchnorm`` (``groupnorm``/``freeze``) converts BatchNorm first.

Unknown names or keys raise a one-line ``ValueError`` naming the key and the
valid choices; :func:`validate_model_spec` runs those checks without
building anything (for the CLI).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from sparta_tf.models.convert import BATCHNORM_MODES, load_keras_model, replace_batchnorm, with_fresh_head
from sparta_tf.models.resnet import HEAD_LAYER_NAME, check_resnet_args, cifar_resnet_gn, resnet18_gn, resnet20_gn
from sparta_tf.models.vit import check_vit_args, vit_tiny
from sparta_tf.models.wrn import check_wrn_args, wrn_gn

__all__ = ["MODEL_REGISTRY", "ModelEntry", "build_model", "validate_model_spec", "keras_cv_backbone_names",
           "keras_hub_backbone_names"]


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """How to build one ``name`` of the ``model:`` section.

    ``builder(spec_kwargs, num_classes, input_shape)`` builds the model from
    the validated keys; ``keys`` are the keys allowed besides ``name``/``args``
    and ``required`` those that must be present.
    """

    builder: Callable[[dict, int, tuple], tf.keras.Model]
    keys: tuple[str, ...]
    required: tuple[str, ...] = ()
    description: str = ""
    check: Callable[[dict], None] = lambda kwargs: None
    """Raises a one-line ValueError for argument values the builder cannot use (no building)."""


_DATA_KEYS = ("num_classes", "input_shape")
_RESERVED_KEYS = ("name", "args")


def _builder_keys(fn: Callable, exclude: Sequence[str] = ()) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters
    return tuple(p for p in params if p not in _DATA_KEYS + _RESERVED_KEYS and p not in exclude)


def _from_function(fn: Callable, **fixed) -> Callable[[dict, int, tuple], tf.keras.Model]:
    def build(kwargs: dict, num_classes: int, input_shape: tuple) -> tf.keras.Model:
        return fn(num_classes=num_classes, input_shape=input_shape, **fixed, **kwargs)

    return build


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


# -------------------------------------------------------------------- saved


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


# --------------------------------------------------------------- pretrained


def _build_pretrained(kwargs: dict, num_classes: int, input_shape: tuple) -> tf.keras.Model:
    from sparta_tf.models.pretrained import card, load_pretrained

    name = kwargs["weights"]
    trained_on = tuple(card(name)["input_shape"])
    if input_shape is not None and tuple(input_shape) != trained_on:
        raise ValueError(f"model.weights={name!r} takes inputs {list(trained_on)}, the data has {list(input_shape)}; "
                         "set data.image_size / data.channels to match")
    model = load_pretrained(name)
    if kwargs.get("fresh_head", True):
        return with_fresh_head(model, num_classes)
    if model.output_shape[-1] != num_classes:
        raise ValueError(f"model.fresh_head=false but {name!r} has {model.output_shape[-1]} outputs for "
                         f"{num_classes} classes")
    return model


def _check_pretrained(kwargs: dict) -> None:
    from sparta_tf.models.pretrained import card

    card(kwargs["weights"])


def _function_entry(function: Callable, description: str, check: Callable[..., None], check_fixed=None,
                    **fixed) -> ModelEntry:
    """A registry entry for a builder function, with some of its arguments fixed; ``check(**fixed_for_check,
    **kwargs)`` is the builder's own argument check."""
    check_fixed = fixed if check_fixed is None else check_fixed
    return ModelEntry(_from_function(function, **fixed), _builder_keys(function, exclude=tuple(fixed)),
                      description=description, check=lambda kwargs: check(**check_fixed, **kwargs))


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
        import os

        if not isinstance(weights, str) or not os.path.isfile(weights):
            raise ValueError(f"model.weights={weights!r} is not a file; give a .weights.h5 file written by "
                             "backbone.save_weights, or leave it out for random weights")


def _check_saved(kwargs: dict) -> None:
    import os

    path = kwargs["path"]
    if not isinstance(path, str) or not os.path.exists(path):
        raise ValueError(f"model.path={path!r} does not exist; point it at a .keras/.h5 file or a SavedModel dir")


MODEL_REGISTRY: dict[str, ModelEntry] = {
    "resnet20_gn": _function_entry(resnet20_gn, "CIFAR ResNet-20, GroupNorm (0.27M)", check_resnet_args,
                                   {"depth": None, "stages": 3}),
    "resnet18_gn": _function_entry(resnet18_gn, "CIFAR ResNet-18, GroupNorm (11.2M)", check_resnet_args,
                                   {"depth": None, "stages": 4}),
    "cifar_resnet_gn": _function_entry(cifar_resnet_gn, "CIFAR ResNet-(6n+2), GroupNorm, any depth (e.g. 8 for CPU runs)",
                                       check_resnet_args, {"stages": 3}),
    "wrn16_4_gn": _function_entry(wrn_gn, "Wide-ResNet-16-4, GroupNorm, pre-activation (2.75M)", check_wrn_args,
                                  depth=16, width=4),
    "wrn_gn": _function_entry(wrn_gn, "Wide-ResNet-depth-width, GroupNorm, pre-activation", check_wrn_args),
    "vit_tiny": _function_entry(vit_tiny, "DeiT-tiny-like ViT, LayerNorm (5.36M at the defaults)", check_vit_args),
    "keras_cv": ModelEntry(
        _build_keras_cv, ("backbone", "backbone_args", "batchnorm"), required=("backbone",),
        description="keras-cv backbone class from explicit args + pool + head", check=_check_keras_cv,
    ),
    "keras_hub": ModelEntry(
        _build_keras_hub, ("backbone", "backbone_args", "batchnorm", "weights"), required=("backbone",),
        description="keras-hub image backbone class from explicit args (Keras 3) + pool + head",
        check=_check_keras_hub,
    ),
    "pretrained": ModelEntry(
        _build_pretrained, ("weights", "fresh_head"), required=("weights",),
        description="a public pre-trained model shipped with sparta-tf (sparta_tf.models.pretrained)",
        check=_check_pretrained,
    ),
    "saved": ModelEntry(
        _build_saved, ("path", "fresh_head", "batchnorm"), required=("path",),
        description="a saved Keras model, with a fresh head by default", check=_check_saved,
    ),
}


def validate_model_spec(spec: Mapping[str, Any]) -> tuple[str, dict]:
    """Checks a ``model:`` section without building; returns ``(name, keyword arguments)``.

    Raises a one-line ``ValueError`` naming the offending key and the valid
    choices.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"model: expected a mapping with a 'name', got {type(spec).__name__}")
    if "name" not in spec:
        raise ValueError(f"model.name is required; valid choices: {sorted(MODEL_REGISTRY)}")
    name = spec["name"]
    if name not in MODEL_REGISTRY:
        raise ValueError(f"model.name={name!r} is unknown; valid choices: {sorted(MODEL_REGISTRY)}")
    entry = MODEL_REGISTRY[name]
    kwargs = {k: v for k, v in spec.items() if k not in _RESERVED_KEYS}
    args = spec.get("args") or {}
    if not isinstance(args, Mapping):
        raise ValueError(f"model.args must be a mapping, got {type(args).__name__}")
    both = sorted(set(kwargs) & set(args))
    if both:
        raise ValueError(f"model.{both[0]} is given both at the top level and under model.args")
    kwargs.update(args)
    for key in kwargs:
        if key in _DATA_KEYS:
            raise ValueError(f"model.{key} is not allowed: {key} comes from the dataset")
        if key not in entry.keys:
            raise ValueError(
                f"model.{key} is not a valid key for model.name={name!r}; valid choices: {list(entry.keys)}"
            )
    for key in entry.required:
        if key not in kwargs:
            raise ValueError(f"model.{key} is required for model.name={name!r}")
    if "batchnorm" in kwargs and kwargs["batchnorm"] not in BATCHNORM_MODES:
        raise ValueError(f"model.batchnorm={kwargs['batchnorm']!r} is not one of {list(BATCHNORM_MODES)}")
    if "backbone_args" in kwargs and not isinstance(kwargs["backbone_args"] or {}, Mapping):
        raise ValueError("model.backbone_args must be a mapping of constructor arguments")
    try:
        entry.check(kwargs)
    except (ValueError, TypeError) as error:
        message = str(error)
        raise ValueError(message if message.startswith("model.") else f"model ({name}): {message}") from None
    return name, kwargs


def build_model(spec: Mapping[str, Any], num_classes: int, input_shape) -> tf.keras.Model:
    """Builds the model of a config's ``model:`` section (see the module docstring).

    Args:
      spec: the ``model:`` mapping (``name`` plus that model's keys).
      num_classes: classes of the dataset (size of the head).
      input_shape: channels-last image shape ``(H, W, C)`` of the dataset.

    Returns:
      An uncompiled ``tf.keras.Model`` mapping images to logits whose
      classifier is the Dense layer named ``"head"``.
    """
    name, kwargs = validate_model_spec(spec)
    input_shape = tuple(int(d) for d in input_shape)
    return MODEL_REGISTRY[name].builder(kwargs, int(num_classes), input_shape)
