"""Per-example gradients of the other convolutions: Conv1D / Conv3D / grouped Conv2D, depthwise,
transposed and separable convolutions (Conv2D with ``groups = 1`` has its own tuned rule in
:mod:`sparta_tf.per_example.layer_rules`).

With ``P(a)`` the im2col patches of an input (:func:`~sparta_tf.per_example.patches.extract_patches_nd`,
``[B, T, prod(k) c]`` over the ``T`` output positions) and ``delta`` the output gradient before
bias and activation:

* **Convolution** (``Conv1D``, ``Conv2D``, ``Conv3D``; dilation, strides, causal padding, ``g``
  groups), kernel ``[*k, c_in/g, c_out]``, probed at ``convolution_op``. Per group ``j`` the
  per-example kernel gradient is ``P_j(a_i)^T delta_ij`` (the group's input channels against its
  output channels)::

      dL_i/dK = einsum("tkgc,tgo->kcgo", P(a_i), delta_i)   reshaped to [*k, c_in/g, c_out]

  With one group it is a linear map on ``T`` positions: ghost or direct norm by the cost model,
  and the clipped sum is the convolution's own filter gradient with ``c * delta`` (one batched op).
* **DepthwiseConv2D**, kernel ``[kh, kw, c, m]``, output channel ``c m + j``:
  ``dL_i/dK[k, c, j] = sum_t P(a_i)[t, k, c] delta_i[t, c, j]``.
* **Conv2DTranspose**, ``y = conv_transpose(x, K)`` with ``K: [kh, kw, f, c_in]``, is the
  gradient of a convolution of ``y``'s shape by ``K``, so ``dL_i/dK = P(delta_i)^T x_i``: the patches
  of the output gradient against the input (a linear map on the input's positions).
* **SeparableConv2D**: a depthwise convolution, then a ``1x1`` convolution; the recording pass runs
  the two separately and probes both, so each kernel gets its own rule above.

Biases: ``dL_i/db = sum_t delta_it``. The probe sits before the activation (the layer's
activation is applied after the probe in recording passes; :mod:`sparta_tf.per_example.layer_rules`).
"""

from __future__ import annotations

import math

import tensorflow as tf

from sparta_tf.backend import depthwise_kernel, variable_key
from sparta_tf.per_example.ghost_rules import (
    GhostRule,
    NormMethod,
    _keep,
    _squared,
    choose_linear_norm,
    keep_examples,
    linear_squared_norms,
)
from sparta_tf.per_example.layer_rules import LayerRule, RecordedCall, _selected_rows, _sum_over_middle_axes
from sparta_tf.per_example.patches import extract_patches_nd

Tensor = tf.Tensor


def _padding(layer) -> str:
    return "VALID" if layer.padding == "causal" else layer.padding.upper()  # causal: padded before the op


def _flat_positions(t: Tensor) -> Tensor:
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


def _positions(t: Tensor) -> int | None:
    spatial = t.shape[1:-1]
    return None if None in spatial else math.prod(spatial)


def _bias_or(layer, delta, selection, kernel_grads):
    if selection.variable is getattr(layer, "bias", None):
        return _sum_over_middle_axes(delta)
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
        return _bias_or(layer, delta, selection, lambda: self.kernel_grads(layer, call.inputs, delta))

    def padded(self, layer, inputs: Tensor) -> Tensor:
        """The recorded input as the convolution sees it (causal padding added where ``call`` adds it)."""
        if self.probe_point != "convolution" and layer.padding == "causal":
            return tf.pad(inputs, causal_padding(layer))
        return inputs

    def patches(self, layer, inputs: Tensor, dtype) -> Tensor:
        """``[B, T, prod(k) c_in]``."""
        return _flat_positions(extract_patches_nd(tf.cast(self.padded(layer, inputs), dtype), tuple(layer.kernel_size),
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
        d = tf.reshape(_flat_positions(delta), tf.stack([batch, -1, groups, outputs // groups]))
        grads = tf.einsum("btkgc,btgo->bkcgo", a, d)
        return tf.reshape(grads, [-1, *kernel_shape])


class DepthwiseRule(LayerRule):
    """DepthwiseConv2D, probed before bias and activation (see module doc)."""

    probe_point = "pre_activation"
    norm_method = "direct"

    def variable_grad(self, layer, call, delta, selection):
        return _bias_or(layer, delta, selection, lambda: depthwise_kernel_grads(layer, call.inputs, delta))


def depthwise_kernel_grads(layer, inputs: Tensor, delta: Tensor) -> Tensor:
    """``[B, kh, kw, c, m]``: ``sum_t P(a)[t, k, c] delta[t, c, m]``."""
    kernel_shape = depthwise_kernel(layer).shape.as_list()
    taps, channels, multiplier = math.prod(kernel_shape[:-2]), kernel_shape[-2], kernel_shape[-1]
    batch = tf.shape(delta)[0]
    patches = extract_patches_nd(tf.cast(inputs, delta.dtype), tuple(layer.kernel_size), tuple(layer.strides),
                                 tuple(layer.dilation_rate), layer.padding.upper())
    a = tf.reshape(patches, tf.stack([batch, -1, taps, channels]))
    d = tf.reshape(_flat_positions(delta), tf.stack([batch, -1, channels, multiplier]))
    return tf.reshape(tf.einsum("btkc,btcm->bkcm", a, d), [-1, *kernel_shape])


class TransposedConvolutionRule(LayerRule):
    """Conv1DTranspose / Conv2DTranspose / Conv3DTranspose without ``output_padding`` (see module doc)."""

    probe_point = "pre_activation"
    norm_method = "direct"

    def variable_grad(self, layer, call, delta, selection):
        return _bias_or(layer, delta, selection, lambda: self.kernel_grads(layer, call.inputs, delta))

    @staticmethod
    def kernel_grads(layer, inputs: Tensor, delta: Tensor) -> Tensor:
        """``[B, *k, f, c_in]``: the patches of ``delta`` (as the forward convolution sees ``y``)
        against the input ``x``."""
        kernel_shape = layer.kernel.shape.as_list()
        patches = _flat_positions(extract_patches_nd(delta, tuple(layer.kernel_size), tuple(layer.strides),
                                                     tuple(layer.dilation_rate), layer.padding.upper()))
        x = _flat_positions(tf.cast(inputs, delta.dtype))
        return tf.reshape(tf.matmul(patches, x, transpose_a=True), [-1, *kernel_shape])


class SeparableRule(LayerRule):
    """SeparableConv2D: the depthwise and the pointwise convolution recorded apart (see module doc).

    ``RecordedCall.args = (x, depthwise output)``, ``probe = [p_depthwise, p_pointwise]``."""

    probe_point = "separable"
    norm_method = "direct"

    def record(self, recording, layer, original_call, args, kwargs):
        x = args[0]
        strides = (1, *layer.strides, 1)
        depthwise = tf.nn.depthwise_conv2d(x, depthwise_kernel(layer), strides, layer.padding.upper(),
                                           dilations=layer.dilation_rate)
        probes = [tf.zeros_like(depthwise)]
        recording.tape.watch(probes)
        pointwise = tf.nn.conv2d(depthwise + probes[0], layer.pointwise_kernel, [1, 1, 1, 1], "VALID")
        probes.append(tf.zeros_like(pointwise))
        recording.tape.watch(probes[1:])
        recording.calls.append(RecordedCall(layer, (x, depthwise), kwargs, probes, original_call))
        output = pointwise + probes[1]
        if layer.use_bias:
            output = tf.nn.bias_add(output, layer.bias)
        return layer.activation(output)

    def variable_grad(self, layer, call, delta, selection):
        x, depthwise = call.args
        delta_depthwise, delta_pointwise = delta
        if selection.variable is getattr(layer, "bias", None):
            return _sum_over_middle_axes(delta_pointwise)
        if selection.variable is depthwise_kernel(layer):
            return depthwise_kernel_grads(layer, x, delta_depthwise)
        a = _flat_positions(tf.cast(depthwise, delta_pointwise.dtype))
        grads = tf.matmul(a, _flat_positions(delta_pointwise), transpose_a=True)
        return tf.reshape(grads, [-1, *layer.pointwise_kernel.shape.as_list()])


CONVOLUTION_RULE = ConvolutionRule("convolution")
PRE_ACTIVATION_CONVOLUTION_RULE = ConvolutionRule("pre_activation")
DEPTHWISE_RULE = DepthwiseRule()
TRANSPOSED_CONVOLUTION_RULE = TransposedConvolutionRule()
SEPARABLE_RULE = SeparableRule()


class ConvolutionGhostRule(GhostRule):
    """Book-keeping for Conv1D / Conv3D (one group): the kernel as a linear map on the ``T`` output
    positions, ``g_i = P(a_i)^T delta_i``. The norm is the ghost norm on the patches or the direct
    per-example gradient, whichever the cost model finds cheaper (direct for an unknown ``T``); a
    ghost-normed kernel's clipped sum is the convolution's filter gradient with ``c * delta``.
    ``reference``: the layer's :class:`ConvolutionRule` (either probe point)."""

    reference: ConvolutionRule

    def squared_norms(self, layer, call, delta, selections, materialised: dict | None = None):
        norms, methods = [], []
        for position, selection in enumerate(selections):
            if selection.variable is layer.kernel and selection.kind != "entries":
                d = _flat_positions(_selected_rows(delta, selection))
                fan_in = math.prod(layer.kernel.shape.as_list()[:-1])
                method, ghost, direct = choose_linear_norm(_positions(delta), fan_in, d.shape[-1])
                if method == "ghost":
                    patches = self.reference.patches(layer, call.inputs, delta.dtype)
                    norms.append(linear_squared_norms(patches, d, "ghost"))
                    methods.append(NormMethod(layer.name, variable_key(selection.variable), "ghost", ghost, direct))
                    continue
            grads = self.reference.per_example_grads(layer, call, delta, [selection])[0]
            _keep(materialised, [(position, grads)])
            norms.append(_squared(grads))
            methods.append(NormMethod(layer.name, variable_key(selection.variable),
                                      "direct" if selection.variable is layer.kernel else "elementwise", None, None))
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

