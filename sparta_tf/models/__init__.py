"""Backbones for DP fine-tuning (GroupNorm only, head = Dense layer "head")."""

from sparta_tf.models.resnet import (
    GN_EPSILON,
    HEAD_LAYER_NAME,
    ChannelPadShortcut,
    cifar_resnet_gn,
    default_groups,
    resnet18_gn,
    resnet20_gn,
)

__all__ = [
    "GN_EPSILON",
    "HEAD_LAYER_NAME",
    "ChannelPadShortcut",
    "cifar_resnet_gn",
    "default_groups",
    "resnet18_gn",
    "resnet20_gn",
]
