"""A small Vision Transformer (DeiT-tiny-like) for per-example DP training.

:func:`vit_tiny` is the ViT of Dosovitskiy et al. (2021) with the DeiT-tiny
width (Touvron et al. 2021: ``dim=192``, 12 blocks, 3 heads, MLP 768, i.e.
5.7M parameters at 224x224 / patch 16), adapted to small images by a smaller
patch (``patch_size=4`` on 32x32 gives 64 patches + 1 class token). With the
defaults on 32x32x3 inputs and 10 classes it has 5,362,762 parameters.
The defaults are the full DeiT-tiny width and depth; for CPU experiments
pass e.g. ``dim=64, depth=4, heads=2, mlp_dim=128`` (0.14M parameters) or
smaller -- only ``dim % heads == 0`` is required.

Architecture (``N = (H/p)(W/p)`` patches, pre-norm blocks)::

    patch_embed   conv p x p, stride p, dim filters       [B, H/p, W/p, dim]
    patch_flatten reshape                                 [B, N, dim]
    cls_token     prepend a learned token c               [B, N+1, dim]
    pos_embed     add a learned position embedding E      [B, N+1, dim]
    block{i}, i = 1..depth:
        x = x + attn(ln1(x))            MultiHeadAttention, heads x dim/heads
        x = x + fc2(gelu(fc1(ln2(x))))  MLP dim -> mlp_dim -> dim
    final_ln -> cls_pool (token 0) -> head (Dense, logits)

with optional dropout after the embeddings, the attention output and each MLP
layer (``dropout``, default 0: DP training rarely uses it).

Per-example gradients. Every weight is owned by a leaf layer so that the
layer-wise engine of :mod:`sparta_tf.per_example` covers the whole model
(no whole-model ``tf.vectorized_map`` fall-back):

* ``patch_embed`` is a Conv2D (im2col rule), ``fc1``/``fc2``/``head`` are
  linear Dense layers (GELU is a separate ``Activation`` layer, so the fast
  Dense rule applies);
* attention is ``tf.keras.layers.MultiHeadAttention``, which owns no weight
  itself: its query/key/value/output projections are ``EinsumDense``
  sublayers (maskable kernels for SPARTA, per-example VJP rule);
* the class token and the position embedding are the single weights of the
  custom leaf layers :class:`ClassToken` and :class:`PositionEmbedding`
  (their rules registered here, :mod:`sparta_tf.per_example.rules.tokens`). Their role in :mod:`sparta_tf.groups` is
  ``"other"``: sparse methods freeze them, ``all`` trains them;
* LayerNorm scale/offset have role ``"norm"``.

Conventions shared with the other backbones: no BatchNorm, the classifier is
the Dense layer named ``"head"`` returning logits, channels-last float32
inputs without normalisation inside the model, stable layer names
(``block{i}_{ln1,attn,attn_dropout,add1,ln2,fc1,gelu,fc2,mlp_dropout,add2}``,
blocks count from 1). Initialisation follows DeiT: truncated normal with std
0.02 for the class token, position embedding and every Dense/attention
kernel, zero biases, LayerNorm epsilon 1e-6.
"""

from __future__ import annotations

from typing import Optional, Tuple

import tensorflow as tf

from sparta_tf.models.resnet import HEAD_LAYER_NAME
from sparta_tf.per_example import register_layer_rule
from sparta_tf.per_example.rules.tokens import LearnedTokenRule

__all__ = ["ClassToken", "PositionEmbedding", "ClassTokenPool", "vit_tiny", "LN_EPSILON"]

#: LayerNorm epsilon of DeiT/timm ViTs.
LN_EPSILON = 1e-6


def _trunc_normal():
    return tf.keras.initializers.TruncatedNormal(stddev=0.02)


@tf.keras.utils.register_keras_serializable(package="sparta_tf")
class ClassToken(tf.keras.layers.Layer):
    """Prepends a learned token: ``[B, N, D] -> [B, N + 1, D]``, ``out[:, 0] = c``.

    Owns its single weight ``token`` (shape ``[1, 1, D]``); its per-example
    gradient is ``dL_i/dc = delta_i[0]`` (:mod:`sparta_tf.per_example.rules.tokens`, registered below).
    """

    def __init__(self, initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.initializer = _trunc_normal() if initializer is None else tf.keras.initializers.get(initializer)

    def build(self, input_shape):
        self.token = self.add_weight(
            name="token", shape=(1, 1, int(input_shape[-1])), initializer=self.initializer, trainable=True
        )
        super().build(input_shape)

    def call(self, inputs):
        batch = tf.shape(inputs)[0]
        token = tf.cast(tf.tile(self.token, [batch, 1, 1]), inputs.dtype)
        return tf.concat([token, inputs], axis=1)

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        n = input_shape[1]
        return tf.TensorShape([input_shape[0], None if n is None else n + 1, input_shape[2]])

    def get_config(self):
        config = super().get_config()
        config.update(initializer=tf.keras.initializers.serialize(self.initializer))
        return config


@tf.keras.utils.register_keras_serializable(package="sparta_tf")
class PositionEmbedding(tf.keras.layers.Layer):
    """Adds a learned position embedding: ``x + E`` with ``E`` of shape ``[1, T, D]``.

    ``T`` (tokens, class token included) and ``D`` come from the input shape,
    which must be static. Owns its single weight ``embedding``; its per-example gradient is
    ``dL_i/dE = delta_i`` (:mod:`sparta_tf.per_example.rules.tokens`, registered below).
    """

    def __init__(self, initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.initializer = _trunc_normal() if initializer is None else tf.keras.initializers.get(initializer)

    def build(self, input_shape):
        tokens, dim = input_shape[1], input_shape[2]
        if tokens is None or dim is None:
            raise ValueError("PositionEmbedding needs a static number of tokens and channels")
        self.embedding = self.add_weight(
            name="embedding", shape=(1, int(tokens), int(dim)), initializer=self.initializer, trainable=True
        )
        super().build(input_shape)

    def call(self, inputs):
        return inputs + tf.cast(self.embedding, inputs.dtype)

    def compute_output_shape(self, input_shape):
        return tf.TensorShape(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(initializer=tf.keras.initializers.serialize(self.initializer))
        return config


register_layer_rule(ClassToken, LearnedTokenRule(first_token_only=True), verify=False)
register_layer_rule(PositionEmbedding, LearnedTokenRule(first_token_only=False), verify=False)


@tf.keras.utils.register_keras_serializable(package="sparta_tf")
class ClassTokenPool(tf.keras.layers.Layer):
    """Reads out the class token: ``[B, T, D] -> [B, D]``, ``out = x[:, 0]``."""

    def call(self, inputs):
        return inputs[:, 0]

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        return tf.TensorShape([input_shape[0], input_shape[2]])


def _dense(units: int, name: str):
    return tf.keras.layers.Dense(
        units, kernel_initializer=_trunc_normal(), bias_initializer="zeros", name=name
    )


def check_vit_args(patch_size: int = 4, dim: int = 192, depth: int = 12, heads: int = 3, mlp_dim: int = 768,
                   dropout: float = 0.0, input_shape=None) -> None:
    """Raises ValueError (one line) for arguments the ViT cannot be built with."""
    for name, value in (("patch_size", patch_size), ("dim", dim), ("depth", depth), ("heads", heads),
                        ("mlp_dim", mlp_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if dim % heads:
        raise ValueError(f"dim={dim} is not divisible by heads={heads}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if input_shape is not None and (input_shape[0] % patch_size or input_shape[1] % patch_size):
        raise ValueError(f"input size {input_shape[0]}x{input_shape[1]} is not a multiple of patch_size={patch_size}")


def vit_tiny(
    num_classes: int = 10,
    input_shape: Tuple[int, int, int] = (32, 32, 3),
    patch_size: int = 4,
    dim: int = 192,
    depth: int = 12,
    heads: int = 3,
    mlp_dim: int = 768,
    dropout: float = 0.0,
    name: Optional[str] = None,
) -> tf.keras.Model:
    """DeiT-tiny-like ViT (see the module docstring for the architecture).

    Args:
      num_classes: size of the head (logits).
      input_shape: channels-last image shape; height and width must be
        multiples of ``patch_size``.
      patch_size: side of the square patches (4 for 32x32 images: 64 tokens).
      dim: token width (192 for DeiT-tiny).
      depth: number of transformer blocks (12).
      heads: attention heads (3); ``dim`` must be divisible by ``heads``.
      mlp_dim: hidden width of the MLPs (768 = 4 * dim).
      dropout: dropout rate after the embeddings, attention output and MLP
        layers (default 0; no Dropout layer is created then).
      name: model name (default ``"vit_tiny"``).

    Returns:
      An uncompiled functional ``tf.keras.Model`` mapping images to logits;
      ``model.get_layer("head")`` is the classifier.
    """
    check_vit_args(patch_size, dim, depth, heads, mlp_dim, dropout, input_shape)
    height, width, _ = input_shape
    tokens = (height // patch_size) * (width // patch_size)

    inputs = tf.keras.Input(shape=tuple(input_shape), name="image")
    x = tf.keras.layers.Conv2D(
        dim, patch_size, strides=patch_size, padding="valid",
        kernel_initializer=_trunc_normal(), name="patch_embed",
    )(inputs)
    x = tf.keras.layers.Reshape((tokens, dim), name="patch_flatten")(x)
    x = ClassToken(name="cls_token")(x)
    x = PositionEmbedding(name="pos_embed")(x)
    if dropout > 0:
        x = tf.keras.layers.Dropout(dropout, name="pos_dropout")(x)
    for i in range(1, depth + 1):
        p = f"block{i}"
        y = tf.keras.layers.LayerNormalization(epsilon=LN_EPSILON, name=f"{p}_ln1")(x)
        y = tf.keras.layers.MultiHeadAttention(
            num_heads=heads, key_dim=dim // heads, kernel_initializer=_trunc_normal(), name=f"{p}_attn"
        )(y, y)
        if dropout > 0:
            y = tf.keras.layers.Dropout(dropout, name=f"{p}_attn_dropout")(y)
        x = tf.keras.layers.Add(name=f"{p}_add1")([x, y])
        y = tf.keras.layers.LayerNormalization(epsilon=LN_EPSILON, name=f"{p}_ln2")(x)
        y = _dense(mlp_dim, f"{p}_fc1")(y)
        y = tf.keras.layers.Activation("gelu", name=f"{p}_gelu")(y)
        y = _dense(dim, f"{p}_fc2")(y)
        if dropout > 0:
            y = tf.keras.layers.Dropout(dropout, name=f"{p}_mlp_dropout")(y)
        x = tf.keras.layers.Add(name=f"{p}_add2")([x, y])
    x = tf.keras.layers.LayerNormalization(epsilon=LN_EPSILON, name="final_ln")(x)
    x = ClassTokenPool(name="cls_pool")(x)
    outputs = _dense(num_classes, HEAD_LAYER_NAME)(x)
    return tf.keras.Model(inputs, outputs, name=name or "vit_tiny")
