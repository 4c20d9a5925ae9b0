"""The zoo's own architectures (:mod:`~sparta_tf.models.resnet`, :mod:`~sparta_tf.models.wrn`,
:mod:`~sparta_tf.models.vit`) as ``model:`` entries: :data:`ARCHITECTURES`, and
:func:`build_architecture`, which builds one of them from a ``model:`` mapping (what a shipped
pre-trained model's card records)."""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from sparta_tf.models.entries import ModelEntry, build, function_entry
from sparta_tf.models.resnet import check_resnet_args, cifar_resnet_gn, resnet18_gn, resnet20_gn
from sparta_tf.models.vit import check_vit_args, vit_tiny
from sparta_tf.models.wrn import check_wrn_args, wrn_gn

__all__ = ["ARCHITECTURES", "build_architecture"]

ARCHITECTURES: dict[str, ModelEntry] = {
    "resnet20_gn": function_entry(resnet20_gn, "CIFAR ResNet-20, GroupNorm (0.27M)", check_resnet_args,
                                  {"depth": None, "stages": 3}),
    "resnet18_gn": function_entry(resnet18_gn, "CIFAR ResNet-18, GroupNorm (11.2M)", check_resnet_args,
                                  {"depth": None, "stages": 4}),
    "cifar_resnet_gn": function_entry(cifar_resnet_gn, "CIFAR ResNet-(6n+2), GroupNorm, any depth (e.g. 8 for CPU runs)",
                                      check_resnet_args, {"stages": 3}),
    "wrn16_4_gn": function_entry(wrn_gn, "Wide-ResNet-16-4, GroupNorm, pre-activation (2.75M)", check_wrn_args,
                                 depth=16, width=4),
    "wrn_gn": function_entry(wrn_gn, "Wide-ResNet-depth-width, GroupNorm, pre-activation", check_wrn_args),
    "vit_tiny": function_entry(vit_tiny, "DeiT-tiny-like ViT, LayerNorm (5.36M at the defaults)", check_vit_args),
}


def build_architecture(spec: Mapping[str, Any], num_classes: int, input_shape) -> tf.keras.Model:
    """The architecture named by the ``model:`` mapping ``spec`` (one of :data:`ARCHITECTURES`), freshly
    initialised, for ``num_classes`` classes and inputs of ``input_shape``."""
    return build(ARCHITECTURES, spec, num_classes, input_shape)
