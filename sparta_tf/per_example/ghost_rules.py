"""Book-keeping rules: per-example gradient norms and clipped sums without per-example gradients.

For a layer ``z = f(a; W)`` and the output gradients ``delta_i = dL_i/dz_i``
recorded by one batched backward pass, DP-SGD needs two things per step:

1. the per-example squared norms ``||g_i||^2`` of the trainable coordinates,
   ``g_i = dL_i/dW`` (for the clip factors ``c_i = min(1, C/||g_i||)``);
2. the clipped sum ``S = sum_i c_i g_i``.

Neither needs the ``[B, *W.shape]`` tensor of per-example gradients:

* **Linear maps** (Dense, and EinsumDense whose equation is a Dense on
  reshaped tensors), with ``a_i: [T, d]`` and ``delta_i: [T, p]`` (``T = 1`` on
  2-D input) and ``g_i = a_i^T delta_i``::

      T = 1:  ||g_i||^2 = ||a_i||^2 ||delta_i||^2                      (rank one)
      T > 1:  ||g_i||^2 = <a_i a_i^T, delta_i delta_i^T>_F            (ghost norm, cost T^2 (d + p))
              or ||a_i^T delta_i||^2 computed for this layer alone     (direct, cost T d p)

  whichever the cost model finds cheaper.
* **Conv2D**: the same with ``a_i`` the ``[H'W', kh kw c_in]`` im2col patches
  (ghost) or the per-example kernel gradient of this layer alone (direct,
  :class:`~sparta_tf.per_example.layer_rules.Conv2DRule`).
* **Norm layers** (GroupNormalization): per-example ``[B, C]`` gradients are
  cheap, computed directly.
* **Any other layer** (fallback): the per-example gradients of that layer
  alone (``tf.vectorized_map`` of its own VJP), reduced to norms at once.

and the clipped sum is the layer's ordinary weight gradient with ``delta``
replaced by ``c * delta`` (book-keeping): ``S = sum_i a_i^T (c_i delta_i)``, one
matmul over ``B*T`` rows; ``tf.nn.conv2d_backprop_filter`` for Conv2D; the
batched VJP of the layer's own call for the fallback.

Row selections slice ``delta`` to the selected output channels before both,
so the work follows the trainable rows. Examples that are not kept (padding,
non-finite norm) have ``c_i = 0`` *and* their ``a_i`` and ``delta_i`` zeroed
with ``tf.where`` first, so ``0 * inf`` cannot leak into ``S``.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.per_example.chunking import chunk_size, map_over_examples
from sparta_tf.per_example.layer_rules import (
    CONV2D_RULE,
    DENSE_RULE,
    PRE_ACTIVATION_VJP_RULE,
    VJP_RULE,
    LayerRule,
    RecordedCall,
    _selected_rows,
    _sum_over_middle_axes,
)
from sparta_tf.per_example.patches import extract_patches
from sparta_tf.precision import to_accumulation

Tensor = tf.Tensor


class NormMethod(NamedTuple):
    """How one selection's per-example norms are computed, with the cost model's numbers
    (multiply-adds per example; ``None`` where a method does not apply)."""

    layer: str
    variable: str
    method: str  # rank_one / ghost / direct / elementwise / per_layer_vjp
    ghost_cost: int | None
    direct_cost: int | None


def choose_linear_norm(positions: int | None, fan_in: int, rows: int) -> tuple[str, int | None, int | None]:
    """``(method, ghost cost, direct cost)`` for ``g_i = a_i^T delta_i``, ``a_i: [T, d]``, ``delta_i: [T, p]``.

    ``T = 1``: rank one. Otherwise the ghost norm costs ``T^2 (d + p)`` and the
    direct per-example gradient ``T d p``; the cheaper one is used (ties: direct).
    ``T`` unknown when the step is traced (a dynamic sequence length): direct, exact for any ``T``.
    """
    if positions is None:
        return "direct", None, None
    direct = positions * fan_in * rows
    if positions == 1:
        return "rank_one", None, direct
    ghost = positions * positions * (fan_in + rows)
    return ("ghost" if ghost < direct else "direct"), ghost, direct


def linear_squared_norms(a: Tensor, d: Tensor, method: str) -> Tensor:
    """``[B]``: ``||a_i^T d_i||_F^2`` for ``a: [B, T, in]``, ``d: [B, T, k]`` by ``method``."""
    if method == "rank_one":
        return tf.reduce_sum(tf.square(a), axis=[1, 2]) * tf.reduce_sum(tf.square(d), axis=[1, 2])
    if method == "ghost":
        gram_a = tf.matmul(a, a, transpose_b=True)  # [B, T, T]
        gram_d = tf.matmul(d, d, transpose_b=True)
        return gram_squared_norms(gram_a, gram_d, 2 * tf.shape(a)[1] + a.shape[-1] + d.shape[-1])
    return tf.reduce_sum(tf.square(tf.matmul(a, d, transpose_a=True)), axis=[1, 2])


def unit_roundoff(dtype: tf.DType) -> float:
    """``u``: half the machine epsilon of ``dtype`` (2^-24 for float32)."""
    return float(np.finfo(dtype.as_numpy_dtype).eps) / 2.0


def gram_squared_norms(gram_a: Tensor, gram_d: Tensor, chain) -> Tensor:
    """``[B]``: ``sum_{t,s} gram_a[t,s] gram_d[t,s]`` raised past its rounding error, so that it is
    never below ``||g_i||^2`` (the ghost norm of ``g_i = sum_t a_t d_t^T``, ``gram = [<x_t, x_s>]``).

    In exact arithmetic the sum is ``||g_i||^2 >= 0``. In floating point its ``T^2`` terms can
    cancel: when an example's positions nearly cancel in ``g_i``, the computed sum can fall far
    below the true squared norm, to zero or below, and the example would escape clipping (one
    crafted example could contribute many times ``C``). The bound: with
    ``R_i = sum_t ||a_t|| ||d_t||`` (from the Grams' diagonals), Cauchy-Schwarz gives
    ``sum_{t,s} |gram_a[t,s] gram_d[t,s]| <= R_i^2``, so the rounding error of the Grams' inner
    products, the products and the sum (over ``s``, then over ``t``) is at most ``gamma_n R_i^2``
    with ``gamma_n = n u / (1 - n u)``, ``n = chain`` (``2T`` plus the Grams' inner lengths) and
    ``u`` the unit roundoff. Returned: ``max(sum, 0) + 2 gamma_n R_i^2`` (doubled for the rounding
    of the bound itself). An ordinary example, whose positions do not cancel, pays at most about
    ``2 gamma_n T`` of its squared norm (0.6% for ResNet-20-GN's 8x8 convolutions, ``n = 768``;
    less where positions correlate): it is clipped slightly more.

    ``u`` is that of IEEE arithmetic in the Grams' dtype: CPUs, and GPUs with TensorFloat-32 off.
    TensorFloat-32 matmuls (TensorFlow's default on Ampere and newer GPUs) and bfloat16 TPU
    matmuls round inputs to 10 and 7 mantissa bits, beyond what this bound covers; a DP step
    turns TensorFloat-32 off (:mod:`sparta_tf.precision`).
    """
    dtype = gram_a.dtype
    raw = tf.reduce_sum(tf.reduce_sum(gram_a * gram_d, axis=2), axis=1)  # two sums of T terms
    diagonal_a = tf.maximum(tf.linalg.diag_part(gram_a), 0.0)
    diagonal_d = tf.maximum(tf.linalg.diag_part(gram_d), 0.0)
    triangle = tf.reduce_sum(tf.sqrt(diagonal_a * diagonal_d), axis=1)  # R_i
    length_u = tf.cast(chain, dtype) * unit_roundoff(dtype)
    gamma = length_u / (1.0 - length_u)
    return tf.maximum(raw, 0.0) + 2.0 * gamma * tf.square(triangle)


def linear_sum(a: Tensor, d: Tensor) -> Tensor:
    """``sum_i a_i^T d_i``: ``[in, k]`` from ``a: [B, T, in]``, ``d: [B, T, k]`` (one matmul over ``B*T``)."""
    return tf.matmul(tf.reshape(a, [-1, a.shape[-1]]), tf.reshape(d, [-1, d.shape[-1]]), transpose_a=True)


def _squared(t: Tensor) -> Tensor:
    """``[B]``: sum of squares of ``[B, ...]``, in the accumulation dtype (float32 for low precision)."""
    t = to_accumulation(t)
    return tf.reduce_sum(tf.reshape(tf.square(t), [tf.shape(t)[0], -1]), axis=1)


def _keep(materialised: dict | None, grads) -> None:
    """Records ``(position, per-example gradients)`` pairs a rule computed anyway."""
    if materialised is not None:
        materialised.update(grads)


def keep_examples(t: Tensor, keep: Tensor) -> Tensor:
    """``t`` with the examples that are not kept set to exactly zero."""
    mask = tf.reshape(keep, [-1] + [1] * (t.shape.rank - 1))
    return tf.where(mask, t, tf.zeros_like(t))


class GhostRule:
    """Per-example squared norms and clipped sums of one layer's selected variables.

    ``squared_norms(layer, call, delta, selections) -> ([B], [NormMethod])`` and
    ``weighted_sums(layer, call, delta_c, keep, selections) -> [compact sums]``
    where ``delta_c = c * delta`` (already zero for examples that are not kept).
    ``reference`` is the materialising rule of the same layer (the same probe point).
    """

    reference: LayerRule = VJP_RULE

    def __init__(self, reference: LayerRule | None = None):
        if reference is not None:
            self.reference = reference

    @property
    def probe_point(self) -> str:
        return self.reference.probe_point

    def record(self, recording, layer, original_call, args, kwargs):
        """What the hooked call does in a recording pass: the reference rule's recording."""
        return self.reference.record(recording, layer, original_call, args, kwargs)

    def squared_norms(self, layer, call, delta, selections, materialised: dict | None = None):
        """``([B], [NormMethod])``; per-example gradients a rule computed anyway go into
        ``materialised[position]`` (compact form), so the engine sums them instead of recomputing."""
        grads = self.reference.per_example_grads(layer, call, delta, selections)
        _keep(materialised, enumerate(grads))
        method = self.reference.norm_method
        methods = [NormMethod(layer.name, variable_key(s.variable), method, None, None) for s in selections]
        return tf.add_n([_squared(g) for g in grads]), methods

    def abs_row_sums(self, layer, call, delta_c, keep, selection, group) -> Tensor:
        """``[n_rows]``: ``sum_i sum_{k in row j} |c_i g_i[k]|`` (``c_i >= 0`` is in ``delta_c``), from
        this layer's own per-example gradients (one layer at a time)."""
        grads = self.reference.per_example_grads(layer, call, delta_c, [selection])[0]
        grads = keep_examples(grads, keep)
        return tf.reduce_sum(group.to_row_view(tf.abs(grads), batch_dims=1), axis=[0, 1])

    def weighted_sums(self, layer, call, delta_c, keep, selections) -> list[Tensor]:
        """``S = sum_i c_i g_i``; the base rule's ``squared_norms`` materialises ``g_i``, which the
        engine sums itself, so only rules that factorise override this."""
        raise NotImplementedError(f"{type(self).__name__} sums materialised per-example gradients")


class LinearGhostRule(GhostRule):
    """Dense and Dense-like EinsumDense, probed before the activation: ``z_i = a_i W + b`` on ``[T, in]``."""

    reference = DENSE_RULE

    def __init__(self, einsum: "EinsumLayout | None" = None):
        self.einsum = einsum
        if einsum is not None:  # DenseRule's per-example gradients assume a Dense layer's shapes
            self.reference = PRE_ACTIVATION_VJP_RULE

    def _operands(self, layer, call, delta) -> tuple[Tensor, Tensor]:
        """``(a: [B, T, in], delta: [B, T, out])`` of the layer as a Dense map."""
        a = tf.cast(call.inputs, delta.dtype)
        fan_in = layer.kernel.shape[0] if self.einsum is None else self.einsum.fan_in
        fan_out = layer.kernel.shape[-1] if self.einsum is None else self.einsum.fan_out
        if self.einsum is None and a.shape.rank == 2:  # [B, in]: one position, statically
            return a[:, None, :], delta[:, None, :]
        batch = tf.shape(a)[0]
        return tf.reshape(a, [batch, -1, fan_in]), tf.reshape(delta, [batch, -1, fan_out])

    def squared_norms(self, layer, call, delta, selections, materialised: dict | None = None):
        a, d = self._operands(layer, call, delta)
        norms, methods = [], []
        for position, selection in enumerate(selections):
            if selection.variable is layer.kernel:
                if selection.kind == "entries":  # no factorisation: this layer's per-example gradients
                    full = tf.matmul(a, d, transpose_a=True)
                    grads = selection.compact(tf.reshape(full, [-1, *selection.shape]), batch_dims=1)
                    method, ghost, direct = "direct", None, None
                else:
                    d_rows = _selected_rows(d, selection)
                    method, ghost, direct = choose_linear_norm(a.shape[1], a.shape[2], d_rows.shape[2])
                    if method != "direct":
                        norms.append(linear_squared_norms(a, d_rows, method))
                        methods.append(NormMethod(layer.name, variable_key(selection.variable), method, ghost, direct))
                        continue
                    grads = tf.matmul(a, d_rows, transpose_a=True)  # [B, in, k]: this layer's only
                    if selection.kind != "rows":
                        grads = tf.reshape(grads, [-1, *selection.shape])
            else:
                grads = selection.compact(self._bias_per_example(layer, d, selection), batch_dims=1)
                method, ghost, direct = "elementwise", None, None
            _keep(materialised, [(position, grads)])
            norms.append(_squared(grads))
            methods.append(NormMethod(layer.name, variable_key(selection.variable), method, ghost, direct))
        return tf.add_n(norms), methods

    def weighted_sums(self, layer, call, delta_c, keep, selections):
        a, d = self._operands(layer, call, delta_c)
        a = keep_examples(a, keep)
        sums = []
        for selection in selections:
            if selection.variable is layer.kernel:
                if selection.kind == "rows":
                    sums.append(linear_sum(a, _selected_rows(d, selection)))
                else:
                    sums.append(selection.compact(tf.reshape(linear_sum(a, d), selection.shape)))
            else:
                bias = tf.reduce_sum(self._bias_per_example(layer, d, selection), axis=0)
                sums.append(selection.compact(bias))
        return sums

    def abs_row_sums(self, layer, call, delta_c, keep, selection, group) -> Tensor:
        """On ``[B, in]`` input the rows factorise exactly:
        ``sum_in |a_i,in c_i delta_i,j| = ||a_i||_1 |c_i delta_i,j|``, so the statistic is
        ``sum_i ||a_i||_1 |c_i delta_i|`` without per-example gradients."""
        a, d = self._operands(layer, call, delta_c)
        if a.shape[1] != 1 or selection.variable is not layer.kernel:
            return super().abs_row_sums(layer, call, delta_c, keep, selection, group)
        l1 = tf.reduce_sum(tf.abs(keep_examples(a, keep)), axis=[1, 2])  # [B]
        return tf.tensordot(l1, tf.abs(d[:, 0, :]), axes=1)

    def _bias_per_example(self, layer, d: Tensor, selection) -> Tensor:
        """``[B, *bias.shape]``: ``sum_t delta_it`` (the bias spans every output unit)."""
        if selection.variable is not getattr(layer, "bias", None):
            raise ValueError(f"{type(layer).__name__} rule cannot handle variable {variable_key(selection.variable)}")
        return tf.reshape(tf.reduce_sum(d, axis=1), [-1, *selection.shape])


class EinsumLayout(NamedTuple):
    """An EinsumDense equation that is a Dense on reshaped tensors: the input's trailing axes are
    contracted with the kernel's leading axes, and the output is the input's other axes followed
    by the kernel's other axes (e.g. ``abc,cde->abde``, ``abcd,cde->abe``)."""

    fan_in: int
    fan_out: int


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


class Conv2DGhostRule(GhostRule):
    """Conv2D (channels last, ``groups = 1``), probed after the convolution (before bias)."""

    reference = CONV2D_RULE

    def squared_norms(self, layer, call, delta, selections, materialised: dict | None = None):
        norms, methods = [], []
        for position, selection in enumerate(selections):
            if selection.variable is not layer.kernel:
                grads = selection.compact(_sum_over_middle_axes(delta), batch_dims=1)
                _keep(materialised, [(position, grads)])
                norms.append(_squared(grads))
                methods.append(NormMethod(layer.name, variable_key(selection.variable), "elementwise", None, None))
                continue
            d = _selected_rows(delta, selection)
            positions = None if None in d.shape[1:3] else d.shape[1] * d.shape[2]
            fan_in = layer.kernel.shape[0] * layer.kernel.shape[1] * layer.kernel.shape[2]
            method, ghost, direct = choose_linear_norm(positions, fan_in, d.shape[-1])
            if selection.kind == "entries":
                method = "direct"
            methods.append(NormMethod(layer.name, variable_key(selection.variable), method, ghost, direct))
            if method == "ghost":
                patches = extract_patches(tf.cast(call.inputs, d.dtype), tuple(layer.kernel_size),
                                          tuple(layer.strides), tuple(layer.dilation_rate), layer.padding.upper())
                batch = tf.shape(d)[0]
                norms.append(linear_squared_norms(tf.reshape(patches, [batch, positions, fan_in]),
                                                  tf.reshape(d, [batch, positions, d.shape[-1]]), "ghost"))
                continue
            grads = self._direct_grads(layer, call, delta, selection, positions, fan_in)
            _keep(materialised, [(position, grads)])
            norms.append(_squared(grads))
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
            d = delta_c if selection.kind != "rows" else _selected_rows(delta_c, selection)
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


class EmbeddingGhostRule(GhostRule):
    """Embedding ``z_it = E[idx_it]``: ``g_i = sum_t e_{idx_it} delta_it^T`` (one-hot rows).

    ``||g_i||^2 = sum_{t,s} [idx_it = idx_is] <delta_it, delta_is>`` (index equality, cost ``T^2 d``)
    and ``S = sum_{i,t} e_{idx_it} (c_i delta_it)^T``: a segment sum over the indices.
    """

    def squared_norms(self, layer, call, delta, selections, materialised: dict | None = None):
        indices, d = self._operands(layer, call, delta)
        same = tf.cast(tf.equal(indices[:, :, None], indices[:, None, :]), d.dtype)  # [B, T, T]
        norms = gram_squared_norms(same, tf.matmul(d, d, transpose_b=True), 2 * tf.shape(d)[1] + d.shape[2])
        rows = d.shape[1]
        cost = None if rows is None else rows * rows * d.shape[2]
        methods = [NormMethod(layer.name, variable_key(s.variable), "index_equality", cost, None) for s in selections]
        if any(s.kind != "dense" for s in selections):  # entries: this layer's per-example gradients
            return super().squared_norms(layer, call, delta, selections, materialised)
        return norms, methods

    def weighted_sums(self, layer, call, delta_c, keep, selections):
        indices, d = self._operands(layer, call, delta_c)
        table = tf.math.unsorted_segment_sum(tf.reshape(d, [-1, d.shape[-1]]), tf.reshape(indices, [-1]),
                                             layer.input_dim)
        return [s.compact(table) for s in selections]

    @staticmethod
    def _operands(layer, call, delta):
        batch = tf.shape(delta)[0]
        indices = tf.reshape(tf.cast(call.inputs, tf.int64), [batch, -1])
        return indices, tf.reshape(delta, [batch, -1, delta.shape[-1]])
