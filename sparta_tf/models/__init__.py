"""Backbones for DP fine-tuning (GroupNorm/LayerNorm only, head = Dense layer "head")."""

from sparta_tf.models.convert import (
    BATCHNORM_MODES,
    load_keras_model,
    replace_batchnorm,
    with_fresh_head,
)
from sparta_tf.models.resnet import (
    GN_EPSILON,
    HEAD_LAYER_NAME,
    ChannelPadShortcut,
    cifar_resnet_gn,
    default_groups,
    resnet18_gn,
    resnet20_gn,
)
from sparta_tf.models.vit import ClassToken, ClassTokenPool, PositionEmbedding, vit_tiny
from sparta_tf.models.wrn import wrn_gn
from sparta_tf.models.zoo import MODEL_REGISTRY, build_model, validate_model_spec

__all__ = [
    "BATCHNORM_MODES",
    "GN_EPSILON",
    "HEAD_LAYER_NAME",
    "MODEL_REGISTRY",
    "ChannelPadShortcut",
    "ClassToken",
    "ClassTokenPool",
    "PositionEmbedding",
    "build_model",
    "cifar_resnet_gn",
    "default_groups",
    "load_keras_model",
    "replace_batchnorm",
    "resnet18_gn",
    "resnet20_gn",
    "validate_model_spec",
    "vit_tiny",
    "with_fresh_head",
    "wrn_gn",
]
