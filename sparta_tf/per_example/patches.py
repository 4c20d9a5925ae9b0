"""im2col for per-example convolution gradients.

``extract_patches(a)[b, h, w, :]`` is the receptive field of output position
``(h, w)``, flattened in ``(kh, kw, c_in)`` order, i.e. the order of a Keras
kernel ``[kh, kw, c_in, c_out]`` reshaped to ``[kh*kw*c_in, c_out]``. Then
``conv(a, K)[b, h, w, :] = patches[b, h, w, :] @ reshape(K, [-1, c_out])`` and
the per-example kernel gradient is ``patches_b^T @ delta_b``.

Built from ``tf.pad`` and strided slices (``tf.image.extract_patches`` gives
the same values but has no XLA-friendly gradient-free fast path on every
backend); padding follows TensorFlow's ``SAME``/``VALID`` rules exactly.
"""

from __future__ import annotations

import tensorflow as tf


def _output_size_and_padding(size: int, kernel: int, stride: int, dilation: int, padding: str):
    """TensorFlow's output length and (before, after) padding for one spatial axis."""
    effective = (kernel - 1) * dilation + 1
    if padding == "VALID":
        return (size - effective) // stride + 1, (0, 0)
    out = -(-size // stride)
    total = max((out - 1) * stride + effective - size, 0)
    return out, (total // 2, total - total // 2)


def extract_patches(
    inputs: tf.Tensor,
    kernel_size: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
    padding: str,
) -> tf.Tensor:
    """``[B, H, W, C] -> [B, H', W', kh*kw*C]`` receptive fields, ``(kh, kw, C)`` order."""
    height, width = inputs.shape[1], inputs.shape[2]
    (kh, kw), (sh, sw), (dh, dw) = kernel_size, strides, dilations
    out_h, pad_h = _output_size_and_padding(height, kh, sh, dh, padding)
    out_w, pad_w = _output_size_and_padding(width, kw, sw, dw, padding)
    if any(pad_h) or any(pad_w):
        inputs = tf.pad(inputs, [[0, 0], list(pad_h), list(pad_w), [0, 0]])
    if (kh, kw, sh, sw) == (1, 1, 1, 1):
        return inputs
    columns = [
        inputs[:, i * dh : i * dh + (out_h - 1) * sh + 1 : sh, j * dw : j * dw + (out_w - 1) * sw + 1 : sw, :]
        for i in range(kh)
        for j in range(kw)
    ]
    return tf.concat(columns, axis=-1) if len(columns) > 1 else columns[0]
