"""Wide Residual Networks (Zagoruyko & Komodakis, 2016) with GroupNorm.

:func:`wrn_gn` builds WRN-``d``-``k`` for CIFAR-sized inputs, the network of
"Wide Residual Networks" (BMVC 2016) with every BatchNorm replaced by
GroupNorm so that per-example gradients are well defined (see
:mod:`sparta_tf.models.resnet` for why BatchNorm is banned). WRN-16-4 is the
default (2.75M parameters with a 10-way head); WRN-28-10 is
``wrn_gn(depth=28, width=10)`` (36.5M), WRN-40-4 ``wrn_gn(depth=40)``.

Architecture (``n = (depth - 4) / 6`` blocks per stage, widths
``16, 16k, 32k, 64k``)::

    stem_conv   conv3x3(16)
    stage 1     n pre-activation blocks, 16k channels, stride 1
    stage 2     n pre-activation blocks, 32k channels, stride 2 (first block)
    stage 3     n pre-activation blocks, 64k channels, stride 2 (first block)
    final_gn -> final_relu -> pool (global average) -> head (Dense, logits)

Pre-activation basic block ``B(3,3)`` (the paper's Fig. 1c, as in the
authors' code), input ``x`` with ``c_in`` channels, output ``c_out``::

    o = relu(GN(x))                                 gn1, relu1
    y = conv3x3(o, stride s)                         conv1
    y = conv3x3(dropout(relu(GN(y))))                gn2, relu2, [dropout], conv2
    out = y + (x                  if c_in == c_out and s == 1
               conv1x1(o, stride s) otherwise)       shortcut_conv

(the projection shortcut sees the *pre-activated* input ``o``, as in the
reference implementation). The depth counts the ``6n`` block convolutions,
the stem convolution, the head and the two 1x1 shortcut convolutions of
stages 2-3 (``6n + 4``); stage 1's first block also needs a projection
(16 -> 16k channels) when ``k > 1``.

Conventions shared with :mod:`sparta_tf.models.resnet`: no BatchNorm, the
classifier head is the only Dense layer and is named ``"head"`` (logits),
convolutions have no bias (``conv_bias=True`` adds one), Keras asymmetric
``"same"`` padding for strided convolutions, channels-last float32 inputs
without normalisation inside the model. Layer names are stable:
``stem_conv``, ``stage{s}_block{b}_{gn1,relu1,conv1,gn2,relu2,dropout,conv2,
shortcut_conv,add}``, ``final_gn``, ``final_relu``, ``pool``, ``head``
(stages and blocks count from 1; ``dropout`` only when ``dropout_rate > 0``).

Group count (``groups``): as in :mod:`sparta_tf.models.resnet`, default
``gcd(32, channels)`` (16 groups on the 16-channel stem output, 32 on every
wider layer), an int for all layers, or a callable ``channels -> groups``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import tensorflow as tf

from sparta_tf.models.resnet import HEAD_LAYER_NAME, GroupsSpec, _conv, _gn, check_groups

__all__ = ["wrn_gn"]


def _preact_block(x, filters, stride, prefix, groups, dropout_rate, conv_bias):
    in_channels = x.shape[-1]
    o = _gn(in_channels, groups, f"{prefix}_gn1")(x)
    o = tf.keras.layers.ReLU(name=f"{prefix}_relu1")(o)
    y = _conv(filters, 3, stride, f"{prefix}_conv1", conv_bias)(o)
    y = _gn(filters, groups, f"{prefix}_gn2")(y)
    y = tf.keras.layers.ReLU(name=f"{prefix}_relu2")(y)
    if dropout_rate > 0:
        y = tf.keras.layers.Dropout(dropout_rate, name=f"{prefix}_dropout")(y)
    y = _conv(filters, 3, 1, f"{prefix}_conv2", conv_bias)(y)
    if stride != 1 or in_channels != filters:
        shortcut = _conv(filters, 1, stride, f"{prefix}_shortcut_conv", conv_bias)(o)
    else:
        shortcut = x
    return tf.keras.layers.Add(name=f"{prefix}_add")([shortcut, y])


def check_wrn_args(depth: int = 16, width: int = 4, groups: GroupsSpec = None, dropout_rate: float = 0.0,
                   conv_bias: bool = False) -> None:
    """Raises ValueError (one line) for arguments a GroupNorm WRN cannot be built with."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 10 or (depth - 4) % 6 != 0:
        raise ValueError(f"WRN depth must be 6n+4 (n >= 1: 10, 16, 22, 28, ...), got {depth!r}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"WRN width must be an integer >= 1, got {width!r}")
    if not isinstance(dropout_rate, (int, float)) or not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    if not isinstance(conv_bias, bool):
        raise ValueError(f"conv_bias={conv_bias!r} must be true or false")
    check_groups(groups, [16, 16 * width, 32 * width, 64 * width])


def wrn_gn(
    depth: int = 16,
    width: int = 4,
    num_classes: int = 10,
    input_shape: Tuple[int, int, int] = (32, 32, 3),
    groups: GroupsSpec = None,
    dropout_rate: float = 0.0,
    conv_bias: bool = False,
    name: Optional[str] = None,
) -> tf.keras.Model:
    """Wide-ResNet WRN-``depth``-``width`` with GroupNorm and pre-activation blocks.

    Args:
      depth: ``6n + 4`` (16, 22, 28, 40, ...); ``n`` blocks per stage.
      width: widening factor ``k``; stage widths are ``16k, 32k, 64k``.
      num_classes: size of the head (logits).
      input_shape: channels-last image shape.
      groups: GroupNorm groups (default ``gcd(32, channels)``; see the module
        docstring).
      dropout_rate: dropout between the two convolutions of each block (the
        paper uses 0.3 in some runs; default 0, no Dropout layer). Dropout is
        per-example, so it is compatible with DP-SGD.
      conv_bias: give convolutions a bias (default False, as in the paper).
      name: model name (default ``"wrn{depth}_{width}_gn"``).

    Returns:
      An uncompiled functional ``tf.keras.Model`` mapping images to logits;
      ``model.get_layer("head")`` is the classifier.
    """
    check_wrn_args(depth, width, groups, dropout_rate, conv_bias)
    n = (depth - 4) // 6
    inputs = tf.keras.Input(shape=tuple(input_shape), name="image")
    x = _conv(16, 3, 1, "stem_conv", conv_bias)(inputs)
    for s, stage_width in enumerate((16 * width, 32 * width, 64 * width), 1):
        for b in range(1, n + 1):
            stride = 2 if (b == 1 and s > 1) else 1
            x = _preact_block(
                x, stage_width, stride, f"stage{s}_block{b}", groups, dropout_rate, conv_bias
            )
    x = _gn(x.shape[-1], groups, "final_gn")(x)
    x = tf.keras.layers.ReLU(name="final_relu")(x)
    x = tf.keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = tf.keras.layers.Dense(num_classes, name=HEAD_LAYER_NAME)(x)
    return tf.keras.Model(inputs, outputs, name=name or f"wrn{depth}_{width}_gn")
