"""Conv2D (channels last, ``groups = 1``): the tuned rule, probed after the convolution.

``z = conv(a, K) + b``; with ``P(a_i)`` the im2col patches ``[H'W', kh*kw*c_in]``
(:mod:`~sparta_tf.per_example.patches`) and ``delta_i`` the gradient at the convolution's output::

    dL_i/dK = reshape(P(a_i)^T delta_i, [kh, kw, c_in, c_out])
    dL_i/db = sum_{h,w} delta_{i,h,w}

one batched matmul, instead of the per-example ``Conv2DBackpropFilter`` that ``tf.vectorized_map``
has no vectorised rule for. Large maps sum over the ``kh*kw`` shifted views of the input instead
(no concatenated copy), and a few output channels use depthwise correlations; all three give the
same values. For rows selections only the selected output channels of ``delta`` enter.

Book-keeping (:class:`Conv2DGhostRule`): the kernel is a linear map on the ``H'W'`` positions, so
its norm is the ghost norm on the patches or the direct per-example gradient (chunked over
examples for large maps), whichever the cost model finds cheaper; the clipped sum is one
``conv2d_backprop_filter`` with ``c * delta``. A unit of several rows (an example's views,
:mod:`~sparta_tf.per_example.units`) takes the ghost norm on its rows' patches merged, or its rows'
direct per-example gradients summed. Registered by
:mod:`~sparta_tf.per_example.rules.convolution`, which picks this rule for a ``Conv2D`` whose
call runs through ``convolution_op`` with ``same`` or ``valid`` padding.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.per_example.chunking import chunk_size, map_over_examples
from sparta_tf.per_example.patches import (
    extract_patches,
    output_size_and_padding,
    pad_like_convolution,
    static_or_dynamic,
)
from sparta_tf.per_example.rules.base import (
    GhostRule,
    LayerRule,
    NormMethod,
    RecordedCall,
    keep_examples,
    keep_materialised,
    selected_rows,
    squared_sum,
    sum_over_middle_axes,
)
from sparta_tf.per_example.rules import ghost_norms  # choose_linear_norm looked up per call (tests patch it)
from sparta_tf.per_example.rules.ghost_norms import linear_squared_norms
from sparta_tf.per_example.units import ONE_ROW, Units

Tensor = tf.Tensor


class Conv2DRule(LayerRule):
    """Conv2D (channels last, ``groups = 1``) via im2col patches and one batched matmul."""

    probe_point = "convolution"
    norm_method = "direct"
    compacts_rows = True

    def variable_grad(self, layer, call, delta, selection):
        if selection.variable is not layer.kernel:
            return self.bias_grad(layer, delta, selection)
        grads = self._kernel_grads(layer, call.inputs, selected_rows(delta, selection))
        if selection.kind == "rows":
            return grads
        return tf.reshape(grads, tf.concat([tf.shape(grads)[:1], selection.shape], axis=0))

    @staticmethod
    def _kernel_grads(layer, inputs: Tensor, delta: Tensor) -> Tensor:
        """``[B, kh*kw*c_in, c]`` for the ``c`` output channels present in ``delta``."""
        if _use_depthwise(layer, delta.shape[-1]):
            return kernel_grads_depthwise(layer, inputs, delta)
        if _use_shifted_views(layer, delta):
            return kernel_grads_shifted(layer, inputs, delta)
        patches = extract_patches(
            tf.cast(inputs, delta.dtype),
            kernel_size=tuple(layer.kernel_size),
            strides=tuple(layer.strides),
            dilations=tuple(layer.dilation_rate),
            padding=layer.padding.upper(),
        )
        batch = tf.shape(patches)[0]
        patches = tf.reshape(patches, [batch, -1, patches.shape[-1]])
        delta = tf.reshape(delta, [batch, -1, delta.shape[-1]])
        return tf.matmul(patches, delta, transpose_a=True)


SHIFTED_MIN_POSITIONS = 64
"""From this many output positions on, per-example kernel gradients are summed
over the ``kh*kw`` shifted views of the input (one batched matmul each) instead
of one matmul over concatenated im2col patches: the same products without the
concatenated copy (measured 1.2-2.3x faster on 2 CPU cores for ResNet-18
layers with >= 8x8 outputs; slower on 4x4 outputs with 512 channels)."""


def _use_shifted_views(layer, delta: Tensor) -> bool:
    positions = delta.shape[1] * delta.shape[2] if None not in delta.shape[1:3] else 0
    return positions >= SHIFTED_MIN_POSITIONS and tuple(layer.dilation_rate) == (1, 1)


def padded_input(layer, inputs: Tensor, dtype) -> Tensor:
    """The input padded exactly as the forward convolution pads it."""
    (kh, kw), (sh, sw) = tuple(layer.kernel_size), tuple(layer.strides)
    padding = layer.padding.upper()
    _, pad_h = output_size_and_padding(static_or_dynamic(inputs, 1), kh, sh, 1, padding)
    _, pad_w = output_size_and_padding(static_or_dynamic(inputs, 2), kw, sw, 1, padding)
    return pad_like_convolution(tf.cast(inputs, dtype), pad_h, pad_w)


def kernel_grads_shifted(layer, inputs: Tensor, delta: Tensor) -> Tensor:
    """``dL_i/dK[u, v] = V_uv(a~_i)^T delta_i`` per kernel offset ``(u, v)``.

    ``V_uv(a~)[h, w] = a~[s h + u, s w + v]`` is the strided view of the padded
    input that kernel tap ``(u, v)`` sees; stacking the ``kh*kw`` products in
    ``(u, v, c_in)`` order gives the ``[B, kh*kw*c_in, c]`` of the im2col form.
    """
    (kh, kw), (sh, sw) = tuple(layer.kernel_size), tuple(layer.strides)
    a = padded_input(layer, inputs, delta.dtype)
    out_h, out_w = delta.shape[1], delta.shape[2]
    batch = tf.shape(delta)[0]
    flat_delta = tf.reshape(delta, [batch, -1, delta.shape[-1]])
    per_offset = []
    for u in range(kh):
        for v in range(kw):
            view = a[:, u : u + (out_h - 1) * sh + 1 : sh, v : v + (out_w - 1) * sw + 1 : sw, :]
            view = tf.reshape(view, [batch, -1, a.shape[-1]])
            per_offset.append(tf.matmul(view, flat_delta, transpose_a=True))
    return tf.concat(per_offset, axis=1) if len(per_offset) > 1 else per_offset[0]


DEPTHWISE_MAX_ROWS = 4
"""Up to this many output channels, per-example kernel gradients use one depthwise
correlation per channel instead of im2col patches (measured on 2 CPU cores:
a multiplier-1 depthwise correlation costs about a ninth of materialising the
patches of a 3x3 layer, so a few rows -- SPARTA's sparse phase at low
density -- are several times cheaper)."""


def _use_depthwise(layer, channels: int | None) -> bool:
    return (
        channels is not None
        and channels <= DEPTHWISE_MAX_ROWS
        and tuple(layer.dilation_rate) == (1, 1)
        and tuple(layer.kernel_size) != (1, 1)
    )


def kernel_grads_depthwise(layer, inputs: Tensor, delta: Tensor) -> Tensor:
    """Per-example kernel gradients as depthwise correlations of inputs with output gradients.

    With the input padded as the forward convolution pads it, ``a~``, stride ``s``::

        dL_i/dK[u, v, c, r] = sum_{h,w} a~_i[s h + u, s w + v, c] delta_i[h, w, r]

    which is a depthwise correlation of ``a~`` laid out ``[c, H, W, B]`` (channels
    = examples) with the filter ``delta[..., r]`` laid out ``[H', W', B, 1]``,
    dilated by ``s``; its ``VALID`` output is exactly ``[c, kh, kw, B]``.
    """
    (kh, kw), (sh, sw) = tuple(layer.kernel_size), tuple(layer.strides)
    x = tf.transpose(padded_input(layer, inputs, delta.dtype), [3, 1, 2, 0])  # [c_in, Hp, Wp, B]
    filters = tf.transpose(delta, [1, 2, 0, 3])  # [H', W', B, rows]
    per_row = [
        tf.nn.depthwise_conv2d(x, filters[..., r : r + 1], [1, 1, 1, 1], "VALID", dilations=[sh, sw])[:, :kh, :kw, :]
        for r in range(delta.shape[-1])
    ]
    grads = tf.stack(per_row, axis=-1)  # [c_in, kh, kw, B, rows]
    grads = tf.transpose(grads, [3, 1, 2, 0, 4])  # [B, kh, kw, c_in, rows]
    return tf.reshape(grads, [tf.shape(delta)[0], -1, delta.shape[-1]])


CONV2D_RULE = Conv2DRule()


class Conv2DGhostRule(GhostRule):
    """Conv2D (channels last, ``groups = 1``), probed after the convolution (before bias)."""

    sums_any_selection = True

    reference = CONV2D_RULE

    def squared_norms(self, layer, call, delta, selections, materialised: dict | None = None):
        return self.unit_squared_norms(layer, call, delta, selections, ONE_ROW, materialised)

    def unit_squared_norms(self, layer, call, delta, selections, units: Units = ONE_ROW,
                           materialised: dict | None = None):
        """Per unit of ``units.rows`` rows: the ghost norm on the unit's rows' patches merged, or
        the rows' direct per-example gradients summed per unit, whichever is cheaper."""
        norms, methods = [], []
        for position, selection in enumerate(selections):
            if selection.variable is not layer.kernel:
                grads = units.sum(selection.compact(sum_over_middle_axes(delta), batch_dims=1))
                keep_materialised(materialised, [(position, grads)])
                norms.append(squared_sum(grads))
                methods.append(NormMethod(layer.name, variable_key(selection.variable), units.method("elementwise"),
                                          None, None))
                continue
            d = selected_rows(delta, selection)
            positions = None if None in d.shape[1:3] else d.shape[1] * d.shape[2]
            fan_in = layer.kernel.shape[0] * layer.kernel.shape[1] * layer.kernel.shape[2]
            method, ghost, direct = ghost_norms.choose_linear_norm(units.positions(positions), fan_in, d.shape[-1])
            if selection.kind == "entries":
                method = "direct"
            methods.append(NormMethod(layer.name, variable_key(selection.variable), units.method(method), ghost, direct))
            if method in ("ghost", "rank_one"):  # never forms this layer's per-example gradients
                patches = extract_patches(tf.cast(call.inputs, d.dtype), tuple(layer.kernel_size),
                                          tuple(layer.strides), tuple(layer.dilation_rate), layer.padding.upper())
                batch = tf.shape(d)[0]
                norms.append(linear_squared_norms(units.merge(tf.reshape(patches, [batch, positions, fan_in])),
                                                  units.merge(tf.reshape(d, [batch, positions, d.shape[-1]])), method))
                continue
            grads = units.sum(self._direct_grads(layer, call, delta, selection, positions, fan_in))
            keep_materialised(materialised, [(position, grads)])
            norms.append(squared_sum(grads))
        return tf.add_n(norms), methods

    def _direct_grads(self, layer, call, delta, selection, positions, fan_in) -> Tensor:
        """This layer's per-example kernel gradients (compact), computed a chunk of examples at a
        time when the whole batch's temporaries (im2col patches or shifted views, ``B x positions
        x fan_in`` floats) would exceed :data:`~sparta_tf.per_example.chunking.CHUNK_BYTES`. Kept
        materialised: ``B x |K|`` floats is far less than the output gradient they replace in the
        clipped sum (ResNet-20-GN's first stage: 1.2 MB against 8 MB at ``B = 128``)."""
        chunk = chunk_size(None if positions is None else 4 * positions * fan_in, delta.shape[0])
        if chunk is None or selection.kind == "entries":
            return self.reference.per_example_grads(layer, call, delta, [selection])[0]
        return map_over_examples(
            lambda inputs, d: self.reference.per_example_grads(
                layer, RecordedCall(layer, (inputs,), {}, None, None), d, [selection])[0],
            [tf.cast(call.inputs, delta.dtype), delta], chunk, selection.compact_shape, delta.dtype)

    def weighted_sums(self, layer, call, delta_c, keep, selections):
        inputs = keep_examples(tf.cast(call.inputs, delta_c.dtype), keep)
        sums = []
        for selection in selections:
            if selection.variable is not layer.kernel:
                sums.append(selection.compact(tf.reduce_sum(delta_c, axis=[0, 1, 2])))
                continue
            d = delta_c if selection.kind != "rows" else selected_rows(delta_c, selection)
            kernel = self._backprop_filter(layer, inputs, d)  # [kh, kw, c_in, k]
            if selection.kind == "rows":
                sums.append(tf.reshape(kernel, [-1, d.shape[-1]]))
            else:
                sums.append(selection.compact(kernel))
        return sums

    @staticmethod
    def _backprop_filter(layer, inputs: Tensor, d: Tensor) -> Tensor:
        """``sum_i dL_i/dK`` for the output channels in ``d``: the convolution's filter gradient."""
        kh, kw = layer.kernel_size
        shape = [kh, kw, inputs.shape[-1], d.shape[-1]]
        if tuple(layer.dilation_rate) == (1, 1):
            return tf.compat.v1.nn.conv2d_backprop_filter(
                inputs, shape, d, strides=[1, *layer.strides, 1], padding=layer.padding.upper())
        kernel = tf.zeros(shape, d.dtype)
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            out = tf.nn.convolution(inputs, kernel, strides=layer.strides, padding=layer.padding.upper(),
                                    dilations=layer.dilation_rate)
        return tape.gradient(out, kernel, output_gradients=d)
