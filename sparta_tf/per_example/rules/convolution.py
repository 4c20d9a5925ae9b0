"""Conv1D / Conv2D / Conv3D (channels last, any groups): per-example gradients and norms.

With ``P(a)`` the im2col patches of an input (:func:`~sparta_tf.per_example.patches.extract_patches_nd`,
``[B, T, prod(k) c]`` over the ``T`` output positions) and ``delta`` the output gradient before
bias and activation, kernel ``[*k, c_in/g, c_out]`` (dilation, strides, causal padding, ``g``
groups). Per group ``j`` the per-example kernel gradient is ``P_j(a_i)^T delta_ij`` (the group's
input channels against its output channels)::

    dL_i/dK = einsum("tkgc,tgo->kcgo", P(a_i), delta_i)   reshaped to [*k, c_in/g, c_out]
    dL_i/db = sum_t delta_it

With one group it is a linear map on ``T`` positions: ghost or direct norm by the cost model
(:mod:`~sparta_tf.per_example.rules.ghost_norms`), and the clipped sum is the convolution's own
filter gradient with ``c * delta`` (one batched op). ``Conv2D`` with ``same`` / ``valid`` padding
and one group gets its tuned rule (:mod:`~sparta_tf.per_example.rules.conv2d`);
``channels_first`` layers get the per-example VJP.
"""

from __future__ import annotations

import math

import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.per_example.patches import extract_patches_nd
from sparta_tf.per_example.registry import register_layer_rule
from sparta_tf.per_example.rules.base import (
    GhostRule,
    LayerRule,
    NormMethod,
    keep_examples,
    keep_materialised,
    selected_rows,
    squared_sum,
    sum_over_middle_axes,
)
from sparta_tf.per_example.rules.conv2d import Conv2DGhostRule
from sparta_tf.per_example.rules import ghost_norms  # choose_linear_norm looked up per call (tests patch it)
from sparta_tf.per_example.rules.ghost_norms import linear_squared_norms
from sparta_tf.per_example.units import ONE_ROW, Units

Tensor = tf.Tensor
L = tf.keras.layers


def channels_last(layer) -> bool:
    """True for a layer that keeps channels on the last axis (the rules' layout)."""
    return getattr(layer, "data_format", "channels_last") == "channels_last"


def _padding(layer) -> str:
    return "VALID" if layer.padding == "causal" else layer.padding.upper()  # causal: padded before the op


def flat_positions(t: Tensor) -> Tensor:
    """``[B, *S, C] -> [B, T, C]`` (``C`` static where it is)."""
    channels = t.shape[-1] if t.shape[-1] is not None else tf.shape(t)[-1]
    return tf.reshape(t, tf.stack([tf.shape(t)[0], -1, channels]))


def causal_padding(layer) -> list:
    """Conv1D's causal padding (channels last): ``dilation (k - 1)`` zeros before the first step."""
    return [[0, 0], [layer.dilation_rate[0] * (layer.kernel_size[0] - 1), 0], [0, 0]]


def calls_convolution_op(layer) -> bool:
    """True when the ``call`` of ``layer``'s class runs its convolution through ``convolution_op``
    (Keras 2's convolutions, Keras 3's Conv2D / Conv3D; Keras 3's Conv1D convolves in ``call``), so
    that a probe at ``convolution_op`` sees every call."""
    code = getattr(type(layer).call, "__code__", None)
    return code is not None and "convolution_op" in code.co_names


def static_positions(t: Tensor) -> int | None:
    """The number of spatial positions of ``[B, *S, C]`` when ``S`` is static, else None."""
    spatial = t.shape[1:-1]
    return None if None in spatial else math.prod(spatial)


def bias_or_kernel(layer, delta, selection, kernel_grads):
    """``dL_i/db = sum_t delta_it`` for the layer's bias, else ``kernel_grads()``."""
    if selection.variable is getattr(layer, "bias", None):
        return sum_over_middle_axes(delta)
    return kernel_grads()


class ConvolutionRule(LayerRule):
    """Conv1D / Conv2D / Conv3D with any groups (see module doc).

    ``probe_point="convolution"``: probed at ``convolution_op``, for a layer whose ``call`` runs its
    convolution through it (:func:`calls_convolution_op`); causal padding is then already in the
    recorded input. ``"pre_activation"``: the probe sits on the layer's output before its activation
    (bias added: the same ``delta``), and causal padding, which the layer applies inside ``call``, is
    applied here to the input. The latter serves several groups (Keras 2 runs their
    ``convolution_op`` inside a jit-compiled ``tf.function`` of its own, where no probe can be read
    from outside) and layers whose ``call`` convolves directly (Keras 3's Conv1D)."""

    norm_method = "direct"

    def __init__(self, probe_point: str):
        self.probe_point = probe_point

    def variable_grad(self, layer, call, delta, selection):
        return bias_or_kernel(layer, delta, selection, lambda: self.kernel_grads(layer, call.inputs, delta))

    def padded(self, layer, inputs: Tensor) -> Tensor:
        """The recorded input as the convolution sees it (causal padding added where ``call`` adds it)."""
        if self.probe_point != "convolution" and layer.padding == "causal":
            return tf.pad(inputs, causal_padding(layer))
        return inputs

    def patches(self, layer, inputs: Tensor, dtype) -> Tensor:
        """``[B, T, prod(k) c_in]``."""
        return flat_positions(extract_patches_nd(tf.cast(self.padded(layer, inputs), dtype), tuple(layer.kernel_size),
                                                  tuple(layer.strides), tuple(layer.dilation_rate), _padding(layer)))

    def convolve(self, layer, inputs: Tensor, kernel: Tensor) -> Tensor:
        """The layer's convolution (one group) of the recorded ``inputs`` by ``kernel``, before bias."""
        return tf.nn.convolution(self.padded(layer, inputs), kernel, strides=tuple(layer.strides),
                                 padding=_padding(layer), dilations=tuple(layer.dilation_rate))

    def kernel_grads(self, layer, inputs: Tensor, delta: Tensor) -> Tensor:
        """``[B, *kernel.shape]``."""
        groups = getattr(layer, "groups", 1)
        kernel_shape = layer.kernel.shape.as_list()
        taps, channels, outputs = math.prod(kernel_shape[:-2]), kernel_shape[-2], kernel_shape[-1]
        batch = tf.shape(delta)[0]
        a = tf.reshape(self.patches(layer, inputs, delta.dtype), tf.stack([batch, -1, taps, groups, channels]))
        d = tf.reshape(flat_positions(delta), tf.stack([batch, -1, groups, outputs // groups]))
        grads = tf.einsum("btkgc,btgo->bkcgo", a, d)
        return tf.reshape(grads, [-1, *kernel_shape])


CONVOLUTION_RULE = ConvolutionRule("convolution")
PRE_ACTIVATION_CONVOLUTION_RULE = ConvolutionRule("pre_activation")


class ConvolutionGhostRule(GhostRule):
    """Book-keeping for Conv1D / Conv3D (one group): the kernel as a linear map on the ``T`` output
    positions, ``g_i = P(a_i)^T delta_i``. The norm is the ghost norm on the patches or the direct
    per-example gradient, whichever the cost model finds cheaper (direct for an unknown ``T``); a
    ghost-normed kernel's clipped sum is the convolution's filter gradient with ``c * delta``.
    ``reference``: the layer's :class:`ConvolutionRule` (either probe point)."""

    reference: ConvolutionRule

    def squared_norms(self, layer, call, delta, selections, materialised: dict | None = None):
        return self.unit_squared_norms(layer, call, delta, selections, ONE_ROW, materialised)

    def unit_squared_norms(self, layer, call, delta, selections, units: Units = ONE_ROW,
                           materialised: dict | None = None):
        """Per unit of ``units.rows`` rows: the ghost norm on the unit's rows' patches merged, or
        the rows' per-example gradients summed per unit."""
        norms, methods = [], []
        for position, selection in enumerate(selections):
            if selection.variable is layer.kernel and selection.kind != "entries":
                d = flat_positions(selected_rows(delta, selection))
                fan_in = math.prod(layer.kernel.shape.as_list()[:-1])
                method, ghost, direct = ghost_norms.choose_linear_norm(units.positions(static_positions(delta)),
                                                                       fan_in, d.shape[-1])
                if method in ("ghost", "rank_one"):  # never forms this layer's per-example gradients
                    patches = self.reference.patches(layer, call.inputs, delta.dtype)
                    norms.append(linear_squared_norms(units.merge(patches), units.merge(d), method))
                    methods.append(NormMethod(layer.name, variable_key(selection.variable), units.method(method),
                                              ghost, direct))
                    continue
            grads = units.sum(self.reference.per_example_grads(layer, call, delta, [selection])[0])
            keep_materialised(materialised, [(position, grads)])
            norms.append(squared_sum(grads))
            method = "direct" if selection.variable is layer.kernel else "elementwise"
            methods.append(NormMethod(layer.name, variable_key(selection.variable), units.method(method), None, None))
        return tf.add_n(norms), methods

    def weighted_sums(self, layer, call, delta_c, keep, selections):
        """Ghost-normed kernels: ``sum_i c_i g_i``, the filter gradient of ``convolution_op``."""
        inputs = keep_examples(tf.cast(call.inputs, delta_c.dtype), keep)
        kernel = tf.cast(tf.convert_to_tensor(layer.kernel), delta_c.dtype)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(kernel)
            output = self.reference.convolve(layer, inputs, kernel)
        total = tape.gradient(output, kernel, output_gradients=delta_c)
        return [selection.compact(total) for selection in selections]


def convolution_rule(layer) -> GhostRule | None:
    """Conv1D / Conv2D / Conv3D, channels last: probed at ``convolution_op`` (one group) where the
    layer's call runs through it, else before the activation; the tuned rule for a Conv2D with
    ``same`` / ``valid`` padding. None (the per-example VJP) for ``channels_first``."""
    if not channels_last(layer):
        return None
    if layer.groups != 1:
        return GhostRule(PRE_ACTIVATION_CONVOLUTION_RULE)
    if not calls_convolution_op(layer):
        return ConvolutionGhostRule(PRE_ACTIVATION_CONVOLUTION_RULE)
    if isinstance(layer, L.Conv2D) and layer.padding in ("same", "valid"):
        return Conv2DGhostRule()
    return ConvolutionGhostRule(CONVOLUTION_RULE)


for _convolution in (L.Conv1D, L.Conv2D, L.Conv3D):
    register_layer_rule(_convolution, convolution_rule, verify=False)
