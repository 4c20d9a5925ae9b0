"""EinsumDense: a Dense on reshaped tensors where the equation allows, else the per-example VJP.

An equation whose input's trailing axes are contracted with the kernel's leading axes, and whose
output is the input's other axes followed by the kernel's other axes (``abc,cde->abde``), is a
Dense ``[T, fan_in] -> [T, fan_out]`` (:class:`~sparta_tf.per_example.rules.dense.EinsumLayout`):
book-keeping by :class:`~sparta_tf.per_example.rules.dense.LinearGhostRule`. Per-example
gradients come from the per-example VJP of the layer's call without its fused activation (any
equation); so do the norms of an equation that is not Dense-like.
"""

from __future__ import annotations

import math
import re

import tensorflow as tf

from sparta_tf.per_example.registry import register_layer_rule
from sparta_tf.per_example.rules.base import PRE_ACTIVATION_VJP_RULE, GhostRule
from sparta_tf.per_example.rules.dense import EinsumLayout, LinearGhostRule


def einsum_layout(layer: tf.keras.layers.EinsumDense) -> EinsumLayout | None:
    """The :class:`EinsumLayout` of ``layer``, or None when its equation is not Dense-like
    (or its bias does not span every output unit)."""
    match = re.fullmatch(r"([a-z]+),([a-z]+)->([a-z]+)", layer.equation.replace(" ", ""))
    if match is None:
        return None
    inputs, kernel, output = match.groups()
    contracted = "".join(c for c in kernel if c in inputs and c not in output)
    free = kernel[len(contracted):]
    batch = inputs[: len(inputs) - len(contracted)]
    if not contracted or kernel != contracted + free or inputs != batch + contracted or output != batch + free:
        return None
    shape = layer.kernel.shape.as_list()
    bias = getattr(layer, "bias", None)
    if bias is not None and bias.shape.as_list() != shape[len(contracted):]:
        return None
    return EinsumLayout(math.prod(shape[: len(contracted)]), math.prod(shape[len(contracted):]))


def einsum_rule(layer: tf.keras.layers.EinsumDense) -> GhostRule:
    """The linear ghost rule for a Dense-like equation, else the per-example VJP's norms."""
    layout = einsum_layout(layer)
    return GhostRule(PRE_ACTIVATION_VJP_RULE) if layout is None else LinearGhostRule(layout)


register_layer_rule(tf.keras.layers.EinsumDense, einsum_rule, verify=False)
