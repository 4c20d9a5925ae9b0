"""CIFAR-style ResNets with GroupNormalization, for per-example DP training.

Two backbones, both Keras functional models built from named layers:

* :func:`resnet20_gn` -- the CIFAR ResNet-20 of He et al. (2016), Sec. 4.2:
  a 3x3 stem, 3 stages x 3 basic blocks with 16/32/64 channels, global
  average pooling and a linear classifier (0.27M parameters with the default
  option-A shortcut). :func:`cifar_resnet_gn` builds the whole 6n+2 family
  (ResNet-20/32/44/56/110).
* :func:`resnet18_gn` -- the "CIFAR" variant of ResNet-18 used throughout the
  DP fine-tuning literature (and in the SPARTA paper's ablation): a 3x3 stride-1
  stem with no max-pool, 4 stages x 2 basic blocks with 64/128/256/512
  channels, 1x1-conv projection shortcuts (11.2M parameters).

Conventions shared by both (later code relies on them):

* **No BatchNormalization anywhere.** BatchNorm mixes the examples of a batch,
  so one example's gradient depends on the others and per-example clipping no
  longer bounds its influence. Every normalisation is a
  ``tf.keras.layers.GroupNormalization`` (per-example statistics).
* **The classifier head is the Dense layer named** ``"head"``
  (:data:`HEAD_LAYER_NAME`); ``model.get_layer(HEAD_LAYER_NAME)`` finds it.
  It is the only Dense layer and the only layer with a bias. It returns
  logits (no softmax): use ``from_logits=True`` losses.
* Convolutions have ``use_bias=False`` by default (the GroupNorm offset that
  follows plays that role, as in torchvision); pass ``conv_bias=True`` to give
  each convolution a bias, e.g. for bias-only fine-tuning experiments.
* Layer names are stable and hierarchical: ``stem_conv``, ``stem_gn``,
  ``stem_relu``, ``stage{s}_block{b}_{conv1,gn1,relu1,conv2,gn2,add,relu2}``,
  shortcuts ``stage{s}_block{b}_shortcut`` (option A, no weights) or
  ``stage{s}_block{b}_shortcut_{conv,gn}`` (projection), ``pool``, ``head``.
  Stages and blocks count from 1.
* Strided 3x3 convolutions use Keras ``padding="same"``, which for an even
  input size pads 0 rows/cols before and 1 after (TensorFlow's asymmetric
  "same"). The PyTorch twin in ``benchmarks/torch_resnet.py`` reproduces this
  exactly (explicit ``ZeroPad2d((0, 1, 0, 1))``), so weights copied across give
  the same outputs.
* Channels-last inputs, float32, no input normalisation inside the model.

Group count (``groups``): ``None`` (default) follows Opacus'
``ModuleValidator.fix`` rule for replacing BatchNorm, ``gcd(32, channels)``
groups per layer -- i.e. what a PyTorch/Opacus user gets when converting a
torchvision-style ResNet, and what the SPARTA authors' Opacus code uses.
For ResNet-20 that is 16 groups on 16 channels (one channel per group), 32 on
32 and 32 on 64; for ResNet-18 it is 32 everywhere. An int ``g`` uses ``g``
groups in every layer (it must divide every layer's width); a callable maps a
layer's channel count to its group count.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple, Union

import tensorflow as tf

__all__ = [
    "HEAD_LAYER_NAME",
    "GN_EPSILON",
    "ChannelPadShortcut",
    "cifar_resnet_gn",
    "resnet20_gn",
    "resnet18_gn",
    "default_groups",
]

#: Name of the classifier head (a ``Dense`` layer) in every model built here.
HEAD_LAYER_NAME = "head"

#: GroupNorm epsilon; PyTorch's default, so that the torch twin matches.
GN_EPSILON = 1e-5

GroupsSpec = Union[None, int, Callable[[int], int]]


def default_groups(channels: int) -> int:
    """Opacus' BatchNorm -> GroupNorm rule: ``gcd(32, channels)`` groups."""
    return math.gcd(32, channels)


def _resolve_groups(groups: GroupsSpec, channels: int) -> int:
    if groups is None:
        g = default_groups(channels)
    elif callable(groups):
        g = int(groups(channels))
    else:
        g = int(groups)
    if g < 1 or channels % g != 0:
        raise ValueError(
            f"GroupNormalization with {g} groups does not divide a layer with "
            f"{channels} channels; choose groups that divide every width, "
            f"pass groups=None (gcd(32, channels)) or a callable."
        )
    return g


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return value


def check_resnet_args(depth: int | None = 20, width: int = 16, groups: GroupsSpec = None, shortcut: str = "A",
                      stages: int = 3, conv_bias: bool = False) -> None:
    """Raises ValueError (one line) for arguments a GroupNorm ResNet cannot be built with."""
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 8
                              or (depth - 2) % 6 != 0):
        raise ValueError(f"CIFAR ResNet depth must be 6n+2 (n >= 1: 8, 14, 20, 32, ...), got {depth!r}")
    _positive_int("width", width)
    if shortcut not in ("A", "B"):
        raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}")
    if not isinstance(conv_bias, bool):
        raise ValueError(f"conv_bias={conv_bias!r} must be true or false")
    check_groups(groups, [width * 2**k for k in range(stages)])


def check_groups(groups: GroupsSpec, widths) -> None:
    """Raises ValueError unless ``groups`` divides every channel width in ``widths``."""
    if groups is not None and not callable(groups):
        _positive_int("groups", groups)
    for channels in widths:
        _resolve_groups(groups, channels)


@tf.keras.utils.register_keras_serializable(package="sparta_tf")
class ChannelPadShortcut(tf.keras.layers.Layer):
    """Parameter-free "option A" shortcut of He et al. (2016).

    Subsamples the spatial axes by ``stride`` (keeping rows/cols 0, s, 2s, ...)
    and zero-pads the channel axis from ``C_in`` to ``out_channels``, half of
    the extra channels before and half after (as in the common PyTorch
    reference implementation ``F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, p, p))``).
    Channels-last input ``[B, H, W, C_in]``.
    """

    def __init__(self, out_channels: int, stride: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.out_channels = int(out_channels)
        self.stride = int(stride)

    def call(self, inputs):
        x = inputs[:, :: self.stride, :: self.stride, :]
        extra = self.out_channels - inputs.shape[-1]
        if extra < 0:
            raise ValueError("ChannelPadShortcut cannot reduce channels.")
        before = extra // 2
        return tf.pad(x, [[0, 0], [0, 0], [0, 0], [before, extra - before]])

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        h, w = input_shape[1], input_shape[2]
        s = self.stride
        h = None if h is None else -(-h // s)
        w = None if w is None else -(-w // s)
        return tf.TensorShape([input_shape[0], h, w, self.out_channels])

    def get_config(self):
        config = super().get_config()
        config.update(out_channels=self.out_channels, stride=self.stride)
        return config


def _conv(filters: int, kernel: int, stride: int, name: str, use_bias: bool):
    return tf.keras.layers.Conv2D(
        filters,
        kernel,
        strides=stride,
        padding="same",
        use_bias=use_bias,
        kernel_initializer="he_normal",
        name=name,
    )


def _gn(channels: int, groups: GroupsSpec, name: str):
    return tf.keras.layers.GroupNormalization(
        groups=_resolve_groups(groups, channels), epsilon=GN_EPSILON, name=name
    )


def _basic_block(
    x,
    filters: int,
    stride: int,
    prefix: str,
    groups: GroupsSpec,
    shortcut: str,
    conv_bias: bool,
):
    """conv3x3-GN-ReLU-conv3x3-GN, plus shortcut, then ReLU."""
    in_channels = x.shape[-1]
    y = _conv(filters, 3, stride, f"{prefix}_conv1", conv_bias)(x)
    y = _gn(filters, groups, f"{prefix}_gn1")(y)
    y = tf.keras.layers.ReLU(name=f"{prefix}_relu1")(y)
    y = _conv(filters, 3, 1, f"{prefix}_conv2", conv_bias)(y)
    y = _gn(filters, groups, f"{prefix}_gn2")(y)
    if stride != 1 or in_channels != filters:
        if shortcut == "A":
            s = ChannelPadShortcut(filters, stride, name=f"{prefix}_shortcut")(x)
        else:  # "B": 1x1 projection + GroupNorm
            s = _conv(filters, 1, stride, f"{prefix}_shortcut_conv", conv_bias)(x)
            s = _gn(filters, groups, f"{prefix}_shortcut_gn")(s)
    else:
        s = x
    y = tf.keras.layers.Add(name=f"{prefix}_add")([y, s])
    return tf.keras.layers.ReLU(name=f"{prefix}_relu2")(y)


def _build(
    *,
    input_shape: Tuple[int, int, int],
    num_classes: int,
    groups: GroupsSpec,
    stem_width: int,
    stage_widths: Sequence[int],
    blocks_per_stage: Sequence[int],
    shortcut: str,
    conv_bias: bool,
    name: str,
) -> tf.keras.Model:
    shortcut = shortcut.upper()
    if shortcut not in ("A", "B"):
        raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}")
    inputs = tf.keras.Input(shape=tuple(input_shape), name="image")
    x = _conv(stem_width, 3, 1, "stem_conv", conv_bias)(inputs)
    x = _gn(stem_width, groups, "stem_gn")(x)
    x = tf.keras.layers.ReLU(name="stem_relu")(x)
    for s, (width, n_blocks) in enumerate(zip(stage_widths, blocks_per_stage), 1):
        for b in range(1, n_blocks + 1):
            stride = 2 if (b == 1 and s > 1) else 1
            x = _basic_block(
                x, width, stride, f"stage{s}_block{b}", groups, shortcut, conv_bias
            )
    x = tf.keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = tf.keras.layers.Dense(num_classes, name=HEAD_LAYER_NAME)(x)
    return tf.keras.Model(inputs, outputs, name=name)


def cifar_resnet_gn(
    depth: int = 20,
    input_shape: Tuple[int, int, int] = (32, 32, 3),
    num_classes: int = 10,
    groups: GroupsSpec = None,
    width: int = 16,
    shortcut: str = "A",
    conv_bias: bool = False,
    name: Optional[str] = None,
) -> tf.keras.Model:
    """CIFAR ResNet of depth ``6n + 2`` (He et al. 2016, Sec. 4.2) with GroupNorm.

    Stem conv3x3(``width``) -> 3 stages of ``n`` basic blocks with ``width``,
    ``2*width``, ``4*width`` channels (stride 2 at the first block of stages 2
    and 3) -> global average pooling -> ``Dense(num_classes, name="head")``.

    Args:
      depth: total number of weighted layers, ``6n + 2`` (20, 32, 44, 56, 110).
      input_shape: channels-last image shape.
      num_classes: size of the head (logits).
      groups: GroupNorm groups; see the module docstring (default
        ``gcd(32, channels)``).
      width: channels of the stem and first stage (16 in the paper).
      shortcut: ``"A"`` (default, the paper's CIFAR choice): parameter-free
        identity with stride-2 subsampling and zero channel padding;
        ``"B"``: 1x1 stride-2 convolution + GroupNorm where the shape changes.
      conv_bias: give convolutions a bias (default False).
      name: model name (default ``"resnet{depth}_gn"``).

    Returns:
      An uncompiled functional ``tf.keras.Model`` mapping images to logits.
    """
    check_resnet_args(depth, width, groups, shortcut, 3, conv_bias)
    n = (depth - 2) // 6
    return _build(
        input_shape=input_shape,
        num_classes=num_classes,
        groups=groups,
        stem_width=width,
        stage_widths=(width, 2 * width, 4 * width),
        blocks_per_stage=(n, n, n),
        shortcut=shortcut,
        conv_bias=conv_bias,
        name=name or f"resnet{depth}_gn",
    )


def resnet20_gn(
    input_shape: Tuple[int, int, int] = (32, 32, 3),
    num_classes: int = 10,
    groups: GroupsSpec = None,
    width: int = 16,
    shortcut: str = "A",
    conv_bias: bool = False,
) -> tf.keras.Model:
    """ResNet-20 for CIFAR with GroupNorm (He et al. 2016; 0.27M parameters).

    3 stages x 3 basic blocks, 16/32/64 channels (for ``width=16``), option-A
    (parameter-free, zero-padding) shortcuts by default. With the defaults it
    has 269,722 parameters: 268,352 conv weights (no conv biases) + 1,376
    GroupNorm scale/offset + 650 in the head. ``shortcut="B"`` (1x1-conv +
    GroupNorm projections) adds 2,752. The classifier head is the Dense layer
    named ``"head"``. See :func:`cifar_resnet_gn` for the arguments.
    """
    return cifar_resnet_gn(
        depth=20,
        input_shape=input_shape,
        num_classes=num_classes,
        groups=groups,
        width=width,
        shortcut=shortcut,
        conv_bias=conv_bias,
        name="resnet20_gn",
    )


def resnet18_gn(
    input_shape: Tuple[int, int, int] = (32, 32, 3),
    num_classes: int = 10,
    groups: GroupsSpec = None,
    width: int = 64,
    shortcut: str = "B",
    conv_bias: bool = False,
) -> tf.keras.Model:
    """ResNet-18, CIFAR variant, with GroupNorm (11.2M parameters).

    The torchvision ResNet-18 with the usual CIFAR changes: a 3x3 stride-1 stem
    convolution and no max-pool, so 32x32 inputs reach the last stage at 4x4.
    4 stages x 2 basic blocks with ``width`` x (1, 2, 4, 8) channels
    (64/128/256/512), stride 2 at the first block of stages 2-4, 1x1-conv +
    GroupNorm projection shortcuts (``shortcut="B"``, the standard choice for
    this network; ``"A"`` is available), global average pooling and the Dense
    head named ``"head"``. Default groups: ``gcd(32, channels)`` = 32.

    Args:
      input_shape: channels-last image shape.
      num_classes: size of the head (logits).
      groups: GroupNorm groups; see the module docstring.
      width: channels of the stem and first stage (64).
      shortcut: ``"B"`` (default) or ``"A"``, as in :func:`cifar_resnet_gn`.
      conv_bias: give convolutions a bias (default False).

    Returns:
      An uncompiled functional ``tf.keras.Model`` mapping images to logits.
    """
    check_resnet_args(None, width, groups, shortcut, 4, conv_bias)
    return _build(
        input_shape=input_shape,
        num_classes=num_classes,
        groups=groups,
        stem_width=width,
        stage_widths=(width, 2 * width, 4 * width, 8 * width),
        blocks_per_stage=(2, 2, 2, 2),
        shortcut=shortcut,
        conv_bias=conv_bias,
        name="resnet18_gn",
    )
