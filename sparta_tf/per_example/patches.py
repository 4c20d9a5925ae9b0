"""im2col for per-example convolution gradients.

``extract_patches(a)[b, h, w, :]`` is the receptive field of output position
``(h, w)``, flattened in ``(kh, kw, c_in)`` order, i.e. the order of a Keras
kernel ``[kh, kw, c_in, c_out]`` reshaped to ``[kh*kw*c_in, c_out]``. Then
``conv(a, K)[b, h, w, :] = patches[b, h, w, :] @ reshape(K, [-1, c_out])`` and
the per-example kernel gradient is ``patches_b^T @ delta_b``.
:func:`extract_patches_nd` is the same for 1, 2 or 3 spatial axes.

Built from ``tf.pad`` and strided slices (``tf.image.extract_patches`` gives
the same values but has no XLA-friendly gradient-free fast path on every
backend); padding follows TensorFlow's ``SAME``/``VALID`` rules exactly.
"""

from __future__ import annotations

import tensorflow as tf


def static_or_dynamic(t: tf.Tensor, axis: int):
    """``t``'s size on ``axis``: a Python int when known when the step is traced, else a scalar tensor."""
    size = t.shape[axis]
    return size if size is not None else tf.shape(t)[axis]


def output_size_and_padding(size, kernel: int, stride: int, dilation: int, padding: str):
    """TensorFlow's output length and (before, after) padding for one spatial axis.

    ``size`` is an int, or a scalar tensor for a size unknown when the step is traced (then the
    results are tensors too)."""
    effective = (kernel - 1) * dilation + 1
    if padding == "VALID":
        return (size - effective) // stride + 1, (0, 0)
    out = -(-size // stride)
    total = (out - 1) * stride + effective - size
    total = max(total, 0) if isinstance(total, int) else tf.maximum(total, 0)
    return out, (total // 2, total - total // 2)


def pad_like_convolution(inputs: tf.Tensor, pad_h, pad_w) -> tf.Tensor:
    """``inputs`` padded by ``(before, after)`` on H and W (ints or scalar tensors); unchanged for zeros."""
    if all(isinstance(p, int) and p == 0 for p in (*pad_h, *pad_w)):
        return inputs
    return tf.pad(inputs, [[0, 0], list(pad_h), list(pad_w), [0, 0]])


def extract_patches(
    inputs: tf.Tensor,
    kernel_size: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
    padding: str,
) -> tf.Tensor:
    """``[B, H, W, C] -> [B, H', W', kh*kw*C]`` receptive fields, ``(kh, kw, C)`` order (H, W may be
    unknown when the step is traced)."""
    return extract_patches_nd(inputs, kernel_size, strides, dilations, padding)


def extract_patches_nd(inputs: tf.Tensor, kernel_size, strides, dilations, padding: str) -> tf.Tensor:
    """``[B, *S, C] -> [B, *S', prod(k)*C]`` receptive fields for ``len(kernel_size)`` spatial axes
    ``S``, in ``(k_1, ..., k_n, C)`` order: a Keras kernel ``[*k, C, c_out]`` reshaped to
    ``[prod(k)*C, c_out]`` multiplies them."""
    spatial = len(kernel_size)
    geometry = [output_size_and_padding(static_or_dynamic(inputs, 1 + axis), kernel_size[axis], strides[axis],
                                         dilations[axis], padding) for axis in range(spatial)]
    if any(not (isinstance(p, int) and p == 0) for _, pads in geometry for p in pads):
        inputs = tf.pad(inputs, [[0, 0]] + [list(pads) for _, pads in geometry] + [[0, 0]])
    if all(k == 1 for k in kernel_size) and all(s == 1 for s in strides):
        return inputs
    columns = []
    for offsets in _kernel_offsets(kernel_size):
        window = [slice(None)]
        for axis, offset in enumerate(offsets):
            out, _ = geometry[axis]
            start = offset * dilations[axis]
            window.append(slice(start, start + (out - 1) * strides[axis] + 1, strides[axis]))
        columns.append(inputs[tuple(window) + (slice(None),)])
    return tf.concat(columns, axis=-1) if len(columns) > 1 else columns[0]


def _kernel_offsets(kernel_size) -> list[tuple[int, ...]]:
    """Every kernel tap, in row-major order (the order of a Keras kernel's spatial axes)."""
    offsets = [()]
    for size in kernel_size:
        offsets = [o + (i,) for o in offsets for i in range(size)]
    return offsets
