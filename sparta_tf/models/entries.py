"""How one ``name`` of a config's ``model:`` section is checked and built: :class:`ModelEntry`, and
:func:`resolve` / :func:`build`, which read a ``model:`` mapping against a registry of entries.

The mapping holds ``name`` and that entry's keyword arguments, at the top level or under ``args:``
(a key given both ways is an error); ``num_classes`` and ``input_shape`` come from the data, never
from the mapping. Every problem is a one-line ``ValueError`` naming the key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

from sparta_tf.models.convert import BATCHNORM_MODES

__all__ = ["ModelEntry", "build", "function_entry", "resolve"]

DATA_KEYS = ("num_classes", "input_shape")
"""Builder arguments that come from the data set, never from the ``model:`` section."""

RESERVED_KEYS = ("name", "args")


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


def _builder_keys(fn: Callable, exclude: Sequence[str] = ()) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters
    return tuple(p for p in params if p not in DATA_KEYS + RESERVED_KEYS and p not in exclude)


def _from_function(fn: Callable, **fixed) -> Callable[[dict, int, tuple], tf.keras.Model]:
    def build_with(kwargs: dict, num_classes: int, input_shape: tuple) -> tf.keras.Model:
        return fn(num_classes=num_classes, input_shape=input_shape, **fixed, **kwargs)

    return build_with


def function_entry(function: Callable, description: str, check: Callable[..., None], check_fixed=None,
                   **fixed) -> ModelEntry:
    """A registry entry for a builder function, with some of its arguments fixed; ``check(**fixed_for_check,
    **kwargs)`` is the builder's own argument check."""
    check_fixed = fixed if check_fixed is None else check_fixed
    return ModelEntry(_from_function(function, **fixed), _builder_keys(function, exclude=tuple(fixed)),
                      description=description, check=lambda kwargs: check(**check_fixed, **kwargs))


def _keyword_arguments(spec: Mapping[str, Any]) -> dict:
    """The mapping's keys besides ``name``/``args``, merged with those under ``args:``."""
    kwargs = {k: v for k, v in spec.items() if k not in RESERVED_KEYS}
    args = spec.get("args") or {}
    if not isinstance(args, Mapping):
        raise ValueError(f"model.args must be a mapping, got {type(args).__name__}")
    both = sorted(set(kwargs) & set(args))
    if both:
        raise ValueError(f"model.{both[0]} is given both at the top level and under model.args")
    kwargs.update(args)
    return kwargs


def _check_keys(name: str, entry: ModelEntry, kwargs: dict) -> None:
    for key in kwargs:
        if key in DATA_KEYS:
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


def resolve(registry: Mapping[str, ModelEntry], spec: Mapping[str, Any]) -> tuple[str, dict]:
    """Checks a ``model:`` mapping against ``registry`` without building; returns ``(name, keyword
    arguments)``, or raises a one-line ``ValueError`` naming the offending key and the valid choices."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"model: expected a mapping with a 'name', got {type(spec).__name__}")
    if "name" not in spec:
        raise ValueError(f"model.name is required; valid choices: {sorted(registry)}")
    name = spec["name"]
    if name not in registry:
        raise ValueError(f"model.name={name!r} is unknown; valid choices: {sorted(registry)}")
    entry = registry[name]
    kwargs = _keyword_arguments(spec)
    _check_keys(name, entry, kwargs)
    try:
        entry.check(kwargs)
    except (ValueError, TypeError) as error:
        message = str(error)
        raise ValueError(message if message.startswith("model.") else f"model ({name}): {message}") from None
    return name, kwargs


def build(registry: Mapping[str, ModelEntry], spec: Mapping[str, Any], num_classes: int,
          input_shape) -> tf.keras.Model:
    """The model of the ``model:`` mapping ``spec`` (checked by :func:`resolve`) for ``num_classes``
    classes and channels-last inputs of ``input_shape``."""
    name, kwargs = resolve(registry, spec)
    input_shape = tuple(int(d) for d in input_shape)
    return registry[name].builder(kwargs, int(num_classes), input_shape)
