"""Conv1DTranspose / Conv2DTranspose / Conv3DTranspose (channels last, no ``output_padding``).

``y = conv_transpose(x, K)`` with ``K: [*k, f, c_in]`` is the gradient of a convolution of ``y``'s
shape by ``K``, so ``dL_i/dK = P(delta_i)^T x_i``: the im2col patches of the output gradient
(before bias and activation) against the input, a linear map on the input's positions;
``dL_i/db = sum_t delta_it``. Other layouts get the per-example VJP.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.per_example.patches import extract_patches_nd
from sparta_tf.per_example.registry import register_layer_rule
from sparta_tf.per_example.rules.base import LayerRule
from sparta_tf.per_example.rules.convolution import bias_or_kernel, channels_last, flat_positions

Tensor = tf.Tensor


class TransposedConvolutionRule(LayerRule):
    """Conv1DTranspose / Conv2DTranspose / Conv3DTranspose without ``output_padding`` (see module doc)."""

    probe_point = "pre_activation"
    norm_method = "direct"

    def variable_grad(self, layer, call, delta, selection):
        return bias_or_kernel(layer, delta, selection, lambda: self.kernel_grads(layer, call.inputs, delta))

    @staticmethod
    def kernel_grads(layer, inputs: Tensor, delta: Tensor) -> Tensor:
        """``[B, *k, f, c_in]``: the patches of ``delta`` (as the forward convolution sees ``y``)
        against the input ``x``."""
        kernel_shape = layer.kernel.shape.as_list()
        patches = flat_positions(extract_patches_nd(delta, tuple(layer.kernel_size), tuple(layer.strides),
                                                     tuple(layer.dilation_rate), layer.padding.upper()))
        x = flat_positions(tf.cast(inputs, delta.dtype))
        return tf.reshape(tf.matmul(patches, x, transpose_a=True), [-1, *kernel_shape])


TRANSPOSED_CONVOLUTION_RULE = TransposedConvolutionRule()


def transposed_rule(layer) -> LayerRule | None:
    """The transposed-convolution rule where it applies, else None (the per-example VJP)."""
    return TRANSPOSED_CONVOLUTION_RULE if channels_last(layer) and layer.output_padding is None else None


for _transposed in (tf.keras.layers.Conv1DTranspose, tf.keras.layers.Conv2DTranspose, tf.keras.layers.Conv3DTranspose):
    register_layer_rule(_transposed, transposed_rule, verify=False)
