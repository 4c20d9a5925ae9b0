"""DepthwiseConv2D and SeparableConv2D (channels last): per-example gradients from patches.

* **DepthwiseConv2D**, kernel ``[kh, kw, c, m]``, output channel ``c m + j``, probed before bias
  and activation: ``dL_i/dK[k, c, j] = sum_t P(a_i)[t, k, c] delta_i[t, c, j]`` with ``P`` the
  im2col patches (:func:`~sparta_tf.per_example.patches.extract_patches_nd`).
* **SeparableConv2D**: a depthwise convolution, then a ``1x1`` convolution; the recording pass runs
  the two separately and probes both, so the depthwise kernel gets the rule above and the
  pointwise kernel ``dL_i/dK_p = D_i^T delta_i`` (``D_i`` the depthwise output at every position).

Biases: ``dL_i/db = sum_t delta_it``. Book-keeping reduces these per-example gradients to norms
one layer at a time. ``channels_first`` layers get the per-example VJP.
"""

from __future__ import annotations

import math

import tensorflow as tf

from sparta_tf.backend import depthwise_kernel
from sparta_tf.per_example.patches import extract_patches_nd
from sparta_tf.per_example.registry import register_layer_rule
from sparta_tf.per_example.rules.base import LayerRule, RecordedCall, sum_over_middle_axes
from sparta_tf.per_example.rules.convolution import bias_or_kernel, channels_last, flat_positions

Tensor = tf.Tensor


class DepthwiseRule(LayerRule):
    """DepthwiseConv2D, probed before bias and activation (see module doc)."""

    probe_point = "pre_activation"
    norm_method = "direct"

    def variable_grad(self, layer, call, delta, selection):
        return bias_or_kernel(layer, delta, selection, lambda: depthwise_kernel_grads(layer, call.inputs, delta))


def depthwise_kernel_grads(layer, inputs: Tensor, delta: Tensor) -> Tensor:
    """``[B, kh, kw, c, m]``: ``sum_t P(a)[t, k, c] delta[t, c, m]``."""
    kernel_shape = depthwise_kernel(layer).shape.as_list()
    taps, channels, multiplier = math.prod(kernel_shape[:-2]), kernel_shape[-2], kernel_shape[-1]
    batch = tf.shape(delta)[0]
    patches = extract_patches_nd(tf.cast(inputs, delta.dtype), tuple(layer.kernel_size), tuple(layer.strides),
                                 tuple(layer.dilation_rate), layer.padding.upper())
    a = tf.reshape(patches, tf.stack([batch, -1, taps, channels]))
    d = tf.reshape(flat_positions(delta), tf.stack([batch, -1, channels, multiplier]))
    return tf.reshape(tf.einsum("btkc,btcm->bkcm", a, d), [-1, *kernel_shape])


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
            return sum_over_middle_axes(delta_pointwise)
        if selection.variable is depthwise_kernel(layer):
            return depthwise_kernel_grads(layer, x, delta_depthwise)
        a = flat_positions(tf.cast(depthwise, delta_pointwise.dtype))
        grads = tf.matmul(a, flat_positions(delta_pointwise), transpose_a=True)
        return tf.reshape(grads, [-1, *layer.pointwise_kernel.shape.as_list()])


DEPTHWISE_RULE = DepthwiseRule()
SEPARABLE_RULE = SeparableRule()


def depthwise_rule(layer) -> LayerRule | None:
    """The depthwise rule for a channels-last layer, else None (the per-example VJP)."""
    return DEPTHWISE_RULE if channels_last(layer) else None


def separable_rule(layer) -> LayerRule | None:
    """The separable rule for a channels-last layer, else None (the per-example VJP)."""
    return SEPARABLE_RULE if channels_last(layer) else None


register_layer_rule(tf.keras.layers.DepthwiseConv2D, depthwise_rule, verify=False)
register_layer_rule(tf.keras.layers.SeparableConv2D, separable_rule, verify=False)
