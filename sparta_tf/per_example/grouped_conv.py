"""Grouped convolutions under ``tf.vectorized_map`` (the vectorized engine).

Keras runs a Conv1D / Conv2D / Conv3D with ``groups > 1`` as TensorFlow's convolution op with a
kernel of ``c_in / groups`` input channels, inside a jit-compiled function of its own (both Keras
lines; XLA takes groups on CPU). Under ``tf.vectorized_map`` pfor rewrites the per-example pass into
plain ops outside XLA (the per-example filter gradient, ``Conv2DBackpropFilter``, in a
``while_loop``), and TensorFlow's own CPU kernels take groups only with oneDNN on: with
``TF_ENABLE_ONEDNN_OPTS=0`` (TensorFlow's default on CPUs without AVX-512) a grouped Conv1D / Conv2D
fails inside the step ("filter_size does not have enough elements"; its input gradient: "Gradients
for grouped convolutions are not supported"), and a grouped Conv3D fails with oneDNN on too ("input
and filter must have the same depth").

:func:`substitute_grouped_convolutions` hooks those layers (channels last, the call Keras defines:
Conv3D always, Conv1D / Conv2D when oneDNN is off); within :func:`vectorizable_convolutions` a
hooked layer computes its call as one ungrouped convolution by the block-diagonal kernel::

    K_dense[..., g c_in/G + c, g' c_out/G + o] = K[..., c, g' c_out/G + o] if g = g' else 0

then bias and activation. The values are the layer's up to float rounding (the zero blocks add
exact zeros, except that ``0 * inf`` is NaN where an input is already infinite); the kernel
gradient is the dense filter gradient's diagonal blocks, the same sums. Every op has a
per-example rule in pfor or an ungrouped CPU kernel. It costs ``G`` times the grouped
convolution's multiply-adds (measured on 2 CPU cores, vectorized engine, B = 16: two 3x3
``groups=32`` layers, 128 channels at 28x28: 374 ms a step with oneDNN off, where the op itself
fails, against 53 ms for TensorFlow's own op with oneDNN on; hence the native op where it works).
Outside that context, and for every other layer, the layer's own call runs.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from sparta_tf.per_example.rules.convolution import PRE_ACTIVATION_CONVOLUTION_RULE, channels_last

L = tf.keras.layers
_STATE = threading.local()
_HOOK_ATTRIBUTE = "_sparta_grouped_conv_hook"
_TRANSPOSED = tuple(getattr(L, name) for name in ("Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose")
                    if hasattr(L, name))


def onednn_on() -> bool:
    """True when TensorFlow runs its oneDNN CPU kernels (``TF_ENABLE_ONEDNN_OPTS``, read at import;
    on by default on CPUs with AVX-512); False where that cannot be told."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return False


def _keras_call(layer) -> bool:
    """True when ``layer``'s ``call`` is Keras's own (not a subclass's override)."""
    owner = next(c for c in type(layer).__mro__ if "call" in vars(c))
    return owner.__module__.split(".")[0] in ("keras", "tf_keras")


def needs_substitute(layer) -> bool:
    """A Conv1D / Conv2D / Conv3D with ``groups > 1``, channels last, running Keras's own call, whose
    per-example gradients TensorFlow's kernels cannot take: a Conv3D, or any with oneDNN off."""
    grouped = (isinstance(layer, (L.Conv1D, L.Conv2D, L.Conv3D)) and not isinstance(layer, _TRANSPOSED)
               and getattr(layer, "groups", 1) > 1 and channels_last(layer) and _keras_call(layer))
    return grouped and (len(layer.kernel_size) == 3 or not onednn_on())


def substitute_grouped_convolutions(layers) -> None:
    """Hooks each layer among ``layers`` that :func:`needs_substitute` (once per layer, as an instance
    attribute: other instances and the class are untouched); the hook is inert outside
    :func:`vectorizable_convolutions`."""
    for layer in layers:
        if needs_substitute(layer) and getattr(layer, _HOOK_ATTRIBUTE, None) is None:
            _install(layer)


def _install(layer) -> None:
    original = layer.call

    def hooked(inputs, *args, **kwargs):
        if not getattr(_STATE, "active", False):
            return original(inputs, *args, **kwargs)
        return grouped_call(layer, inputs)

    object.__setattr__(layer, "call", hooked)
    object.__setattr__(layer, _HOOK_ATTRIBUTE, True)


@contextlib.contextmanager
def vectorizable_convolutions():
    """Within this block, hooked grouped convolutions compute their call by :func:`grouped_call`
    (re-entrant; per thread)."""
    previous = getattr(_STATE, "active", False)
    _STATE.active = True
    try:
        yield
    finally:
        _STATE.active = previous


def grouped_call(layer, inputs: tf.Tensor) -> tf.Tensor:
    """``layer(inputs)`` of a grouped convolution (channels last) as one convolution by the
    block-diagonal kernel."""
    kernel = tf.cast(tf.convert_to_tensor(layer.kernel), inputs.dtype)  # Keras 3: LoRA included
    z = PRE_ACTIVATION_CONVOLUTION_RULE.convolve(layer, inputs, block_diagonal(kernel, layer.groups))
    if layer.use_bias:
        z = z + tf.cast(tf.convert_to_tensor(layer.bias), z.dtype)
    return z if layer.activation is None else layer.activation(z)


def block_diagonal(kernel: tf.Tensor, groups: int) -> tf.Tensor:
    """``[*k, c_in / g, c_out] -> [*k, c_in, c_out]``, zero outside the groups' blocks."""
    *window, group_channels, outputs = kernel.shape.as_list()
    blocks = tf.reshape(kernel, [*window, group_channels, groups, outputs // groups])
    dense = tf.einsum("...cjo,ij->...icjo", blocks, tf.eye(groups, dtype=kernel.dtype))
    return tf.reshape(dense, [*window, groups * group_channels, outputs])
