"""Public pre-trained models shipped with sparta-tf, so every run and every user starts from the same one.

DP fine-tuning needs a model pre-trained on *public* data; none can be
downloaded here, so the project pre-trains its own, non-privately, once
(``benchmarks/pretrain_public.py``), and ships the weights in
``sparta_tf/models/weights/``: ``<name>.weights.h5`` and ``<name>.json``,
which records the architecture (a ``model:`` section of the zoo), the input
shape and classes it was trained on, the public data, the exact command, its
test accuracy and the SHA-256 of the weights file (checked on every load).

Use one by name::

    model: {name: pretrained, weights: cifar5-resnet20-gn}        # sparta-train: fresh head by default
    model = sparta_tf.models.pretrained.load_pretrained("cifar5-resnet20-gn")  # Python: with its public head
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import tensorflow as tf

from sparta_tf.models.architectures import build_architecture
from sparta_tf.models.convert import with_fresh_head
from sparta_tf.models.entries import ModelEntry

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
__all__ = ["PRETRAINED", "WEIGHTS_DIR", "available", "card", "load_pretrained", "sha256"]


def available() -> list[str]:
    """Names of the shipped pre-trained models."""
    if not os.path.isdir(WEIGHTS_DIR):
        return []
    return sorted(f[: -len(".json")] for f in os.listdir(WEIGHTS_DIR) if f.endswith(".json"))


def card(name: str) -> dict[str, Any]:
    """The model card (``<name>.json``) of a shipped model; ValueError for an unknown name."""
    path = os.path.join(WEIGHTS_DIR, f"{name}.json")
    if not os.path.exists(path):
        raise ValueError(f"model.weights={name!r} is not a shipped pre-trained model; valid choices: {available()}")
    with open(path) as f:
        return json.load(f)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_pretrained(name: str) -> tf.keras.Model:
    """The shipped model ``name`` with its pre-trained weights (and its public head), checksum-verified."""
    info = card(name)
    weights = os.path.join(WEIGHTS_DIR, f"{name}.weights.h5")
    if not os.path.exists(weights) or sha256(weights) != info["sha256"]:
        raise ValueError(f"the weights of {name!r} ({weights}) are missing or do not match their recorded "
                         "SHA-256; reinstall sparta-tf")
    model = build_architecture(info["model"], info["num_classes"], tuple(info["input_shape"]))
    model.load_weights(weights)
    return model


def _build_pretrained(kwargs: dict, num_classes: int, input_shape: tuple) -> tf.keras.Model:
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
    card(kwargs["weights"])


PRETRAINED = ModelEntry(
    _build_pretrained, ("weights", "fresh_head"), required=("weights",),
    description="a public pre-trained model shipped with sparta-tf (sparta_tf.models.pretrained)",
    check=_check_pretrained,
)
