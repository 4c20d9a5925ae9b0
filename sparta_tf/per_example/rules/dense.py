"""Dense: per-example gradients and book-keeping norms of ``z = a W + b``.

With ``a: [B, ..., in]`` and ``delta`` the output gradient before the activation (the probe sits
before a fused ``activation=``)::

    dL_i/dW = sum_t a_{i,t}^T delta_{i,t}       ([in, out])
    dL_i/db = sum_t delta_{i,t}                  ([out])

For rows selections only the selected output channels of ``delta`` enter the matmul,
``dW_i[:, rows] = a_i^T delta_i[..., rows]``, so the cost follows the trainable rows. Book-keeping
(:class:`LinearGhostRule`): rank one, ghost or direct norm by cost
(:mod:`~sparta_tf.per_example.rules.ghost_norms`); the clipped sum is one matmul over ``B*T`` rows.
The same ghost rule serves Dense-like ``EinsumDense`` (:mod:`~sparta_tf.per_example.rules.einsum`).
Units of several rows (an example's views) merge their rows' positions first
(:meth:`LinearGhostRule.unit_squared_norms`, :mod:`~sparta_tf.per_example.units`).
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.per_example.registry import register_layer_rule
from sparta_tf.per_example.rules.base import (
    PRE_ACTIVATION_VJP_RULE,
    GhostRule,
    LayerRule,
    NormMethod,
    keep_examples,
    keep_materialised,
    selected_rows,
    squared_sum,
)
from sparta_tf.per_example.rules import ghost_norms  # choose_linear_norm looked up per call (tests patch it)
from sparta_tf.per_example.rules.ghost_norms import linear_squared_norms, linear_sum
from sparta_tf.per_example.units import ONE_ROW, Units

Tensor = tf.Tensor


class DenseRule(LayerRule):
    """Dense, probed before its activation: ``dW_i = sum_t a_it^T delta_it``, ``db_i = sum_t delta_it``."""

    probe_point = "pre_activation"
    norm_method = "direct"
    compacts_rows = True

    def variable_grad(self, layer, call, delta, selection):
        if selection.variable is not layer.kernel:
            return self.bias_grad(layer, delta, selection)
        a = tf.cast(call.inputs, delta.dtype)
        d = selected_rows(delta, selection)
        if a.shape.rank == 2:
            return a[:, :, None] * d[:, None, :]
        batch = tf.shape(a)[0]
        a3 = tf.reshape(a, [batch, -1, a.shape[-1]])
        d3 = tf.reshape(d, [batch, -1, d.shape[-1]])
        return tf.matmul(a3, d3, transpose_a=True)


DENSE_RULE = DenseRule()


class EinsumLayout(NamedTuple):
    """An EinsumDense equation that is a Dense on reshaped tensors: the input's trailing axes are
    contracted with the kernel's leading axes, and the output is the input's other axes followed
    by the kernel's other axes (e.g. ``abc,cde->abde``, ``abcd,cde->abe``)."""

    fan_in: int
    fan_out: int


class LinearGhostRule(GhostRule):
    """Dense and Dense-like EinsumDense, probed before the activation: ``z_i = a_i W + b`` on ``[T, in]``."""

    sums_any_selection = True

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
        return self.unit_squared_norms(layer, call, delta, selections, ONE_ROW, materialised)

    def unit_squared_norms(self, layer, call, delta, selections, units: Units = ONE_ROW,
                           materialised: dict | None = None):
        """Per unit of ``units.rows`` rows: the map on the unit's rows' positions merged
        (:meth:`~sparta_tf.per_example.units.Units.merge`), so every norm below is the unit's."""
        a, d = (units.merge(t) for t in self._operands(layer, call, delta))
        norms, methods = [], []
        for position, selection in enumerate(selections):
            ghost = direct = None
            if selection.variable is not layer.kernel:
                grads = selection.compact(self._bias_per_example(layer, d, selection), batch_dims=1)
                method = "elementwise"
            elif selection.kind == "entries":  # no factorisation: this layer's per-example gradients
                full = tf.matmul(a, d, transpose_a=True)
                grads, method = selection.compact(tf.reshape(full, [-1, *selection.shape]), batch_dims=1), "direct"
            else:
                d_rows = selected_rows(d, selection)
                method, ghost, direct = ghost_norms.choose_linear_norm(a.shape[1], a.shape[2], d_rows.shape[2])
                if method != "direct":
                    norms.append(linear_squared_norms(a, d_rows, method))
                    methods.append(NormMethod(layer.name, variable_key(selection.variable), units.method(method),
                                              ghost, direct))
                    continue
                grads = tf.matmul(a, d_rows, transpose_a=True)  # [B, in, k]: this layer's only
                if selection.kind != "rows":
                    grads = tf.reshape(grads, [-1, *selection.shape])
            keep_materialised(materialised, [(position, grads)])
            norms.append(squared_sum(grads))
            methods.append(NormMethod(layer.name, variable_key(selection.variable), units.method(method), ghost, direct))
        return tf.add_n(norms), methods

    def weighted_sums(self, layer, call, delta_c, keep, selections):
        a, d = self._operands(layer, call, delta_c)
        a = keep_examples(a, keep)
        sums = []
        for selection in selections:
            if selection.variable is layer.kernel:
                if selection.kind == "rows":
                    sums.append(linear_sum(a, selected_rows(d, selection)))
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


register_layer_rule(tf.keras.layers.Dense, LinearGhostRule(), verify=False)
