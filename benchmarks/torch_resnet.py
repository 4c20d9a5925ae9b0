"""PyTorch twin of ``sparta_tf.models.resnet`` (ResNet-20-GN / ResNet-18-GN).

Used by ``benchmarks/step_time.py`` for the PyTorch and Opacus reference
numbers. The architecture is the same function as the Keras model, layer for
layer, so that step times compare like with like:

* same widths (16/32/64 for ResNet-20), same blocks, ``bias=False`` convs,
  ``nn.GroupNorm`` with the same group counts (default ``gcd(32, C)``, the rule
  of Opacus' ``ModuleValidator.fix``) and eps ``1e-5``;
* same shortcut option: ``"A"`` (stride-2 subsample + symmetric zero channel
  padding, no weights) for ResNet-20, ``"B"`` (1x1 conv + GroupNorm) for
  ResNet-18;
* TensorFlow's asymmetric ``padding="same"`` for stride-2 3x3 convolutions is
  reproduced with an explicit ``nn.ZeroPad2d((0, 1, 0, 1))`` followed by an
  unpadded conv (PyTorch's symmetric ``padding=1`` would shift the sampling
  grid by one pixel). For stride 1 ``padding=1`` is identical to "same".

Module names mirror the Keras layer names (``stem.conv``  <->  ``stem_conv``,
``stage2.block1.gn1``  <->  ``stage2_block1_gn1``, ``head``  <->  ``head``), and
:func:`load_keras_weights` copies a Keras model's weights into the twin; the
two then agree to float32 round-off (checked in ``tests/test_models.py``).

Only ``torch`` is needed to import this file (no TensorFlow, no Opacus).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ResNetGN",
    "resnet20_gn",
    "resnet18_gn",
    "cifar_resnet_gn",
    "load_keras_weights",
]

GN_EPSILON = 1e-5
GroupsSpec = Union[None, int, Callable[[int], int]]


def _groups(groups: GroupsSpec, channels: int) -> int:
    if groups is None:
        g = math.gcd(32, channels)
    elif callable(groups):
        g = int(groups(channels))
    else:
        g = int(groups)
    if g < 1 or channels % g != 0:
        raise ValueError(f"{g} groups do not divide {channels} channels")
    return g


class SameConv2d(nn.Sequential):
    """Conv2d with TensorFlow "same" padding (asymmetric for stride 2)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, bias: bool):
        if stride == 1:
            super().__init__(nn.Conv2d(cin, cout, kernel, 1, kernel // 2, bias=bias))
        else:
            # For even inputs and stride 2, TF pads total (kernel - 2) rows:
            # (kernel - 2) // 2 before, the rest after (k=3: 0 before, 1 after;
            # k=1: none).
            total = max(kernel - stride, 0)
            before, after = total // 2, total - total // 2
            layers = []
            if total:
                layers.append(nn.ZeroPad2d((before, after, before, after)))
            layers.append(nn.Conv2d(cin, cout, kernel, stride, 0, bias=bias))
            super().__init__(*layers)

    @property
    def conv(self) -> nn.Conv2d:
        return self[-1]


class ChannelPadShortcut(nn.Module):
    """Option-A shortcut: ``x[:, :, ::s, ::s]`` zero-padded to ``cout`` channels."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.stride = stride
        extra = cout - cin
        self.before, self.after = extra // 2, extra - extra // 2

    def forward(self, x):
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.before, self.after))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, groups, shortcut, conv_bias):
        super().__init__()
        self.conv1 = SameConv2d(cin, cout, 3, stride, conv_bias)
        self.gn1 = nn.GroupNorm(_groups(groups, cout), cout, eps=GN_EPSILON)
        self.conv2 = SameConv2d(cout, cout, 3, 1, conv_bias)
        self.gn2 = nn.GroupNorm(_groups(groups, cout), cout, eps=GN_EPSILON)
        if stride != 1 or cin != cout:
            if shortcut == "A":
                self.shortcut = ChannelPadShortcut(cin, cout, stride)
            else:
                self.shortcut = nn.Sequential()
                self.shortcut.add_module("conv", SameConv2d(cin, cout, 1, stride, conv_bias))
                self.shortcut.add_module(
                    "gn", nn.GroupNorm(_groups(groups, cout), cout, eps=GN_EPSILON)
                )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        y = F.relu(self.gn1(self.conv1(x)))
        y = self.gn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNetGN(nn.Module):
    """Stem conv3x3 -> stages of BasicBlocks -> global average pool -> head."""

    def __init__(
        self,
        stage_widths: Sequence[int],
        blocks_per_stage: Sequence[int],
        num_classes: int = 10,
        in_channels: int = 3,
        groups: GroupsSpec = None,
        shortcut: str = "A",
        conv_bias: bool = False,
        stem_width: Optional[int] = None,
    ):
        super().__init__()
        shortcut = shortcut.upper()
        if shortcut not in ("A", "B"):
            raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}")
        stem_width = stem_width or stage_widths[0]
        self.stem = nn.Sequential()
        self.stem.add_module("conv", SameConv2d(in_channels, stem_width, 3, 1, conv_bias))
        self.stem.add_module("gn", nn.GroupNorm(_groups(groups, stem_width), stem_width, eps=GN_EPSILON))
        self.stem.add_module("relu", nn.ReLU())
        cin = stem_width
        self.stages = nn.ModuleList()
        for s, (width, n) in enumerate(zip(stage_widths, blocks_per_stage)):
            stage = nn.Module()
            for b in range(n):
                stride = 2 if (b == 0 and s > 0) else 1
                stage.add_module(
                    f"block{b + 1}", BasicBlock(cin, width, stride, groups, shortcut, conv_bias)
                )
                cin = width
            self.stages.append(stage)
        self.head = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            for block in stage.children():
                x = block(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.head(x)


def cifar_resnet_gn(depth=20, num_classes=10, groups=None, width=16, shortcut="A", conv_bias=False):
    """CIFAR ResNet of depth 6n+2 (twin of ``sparta_tf.models.cifar_resnet_gn``)."""
    if depth < 8 or (depth - 2) % 6 != 0:
        raise ValueError(f"depth must be 6n+2, got {depth}")
    n = (depth - 2) // 6
    return ResNetGN((width, 2 * width, 4 * width), (n, n, n), num_classes,
                    groups=groups, shortcut=shortcut, conv_bias=conv_bias)


def resnet20_gn(num_classes=10, groups=None, width=16, shortcut="A", conv_bias=False):
    """ResNet-20-GN (twin of ``sparta_tf.models.resnet20_gn``; 269,722 params)."""
    return cifar_resnet_gn(20, num_classes, groups, width, shortcut, conv_bias)


def resnet18_gn(num_classes=10, groups=None, width=64, shortcut="B", conv_bias=False):
    """ResNet-18-GN, CIFAR variant (twin of ``sparta_tf.models.resnet18_gn``)."""
    w = width
    return ResNetGN((w, 2 * w, 4 * w, 8 * w), (2, 2, 2, 2), num_classes,
                    groups=groups, shortcut=shortcut, conv_bias=conv_bias)


def _keras_name(torch_name: str) -> str:
    """``stages.1.block1.conv1.0`` -> ``stage2_block1_conv1`` etc."""
    parts = torch_name.split(".")
    out = []
    i = 0
    while i < len(parts):
        p = parts[i]
        if p == "stages":
            out.append(f"stage{int(parts[i + 1]) + 1}")
            i += 2
            continue
        if p.isdigit():  # index inside a SameConv2d Sequential
            i += 1
            continue
        out.append(p)
        i += 1
    return "_".join(out)


@torch.no_grad()
def load_keras_weights(torch_model: ResNetGN, keras_model) -> ResNetGN:
    """Copy the weights of a Keras twin into ``torch_model`` (in place).

    Conv kernels go from Keras ``[kh, kw, in, out]`` to PyTorch
    ``[out, in, kh, kw]``; Dense ``[in, out]`` to Linear ``[out, in]``;
    GroupNorm gamma/beta to weight/bias. Raises if any module is unmatched.
    """
    for name, module in torch_model.named_modules():
        if isinstance(module, nn.Conv2d):
            layer = keras_model.get_layer(_keras_name(name))
            w = layer.kernel.numpy()
            module.weight.copy_(torch.from_numpy(w.transpose(3, 2, 0, 1).copy()))
            if module.bias is not None:
                module.bias.copy_(torch.from_numpy(layer.bias.numpy()))
        elif isinstance(module, nn.GroupNorm):
            layer = keras_model.get_layer(_keras_name(name))
            if layer.groups != module.num_groups:
                raise ValueError(f"{name}: groups {module.num_groups} != {layer.groups}")
            module.weight.copy_(torch.from_numpy(layer.gamma.numpy()))
            module.bias.copy_(torch.from_numpy(layer.beta.numpy()))
        elif isinstance(module, nn.Linear):
            layer = keras_model.get_layer(_keras_name(name))
            module.weight.copy_(torch.from_numpy(layer.kernel.numpy().T.copy()))
            module.bias.copy_(torch.from_numpy(layer.bias.numpy()))
    n_torch = sum(p.numel() for p in torch_model.parameters())
    if n_torch != keras_model.count_params():
        raise ValueError(f"parameter counts differ: torch {n_torch} vs keras {keras_model.count_params()}")
    return torch_model
