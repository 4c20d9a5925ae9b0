"""Embedding, ``z_it = E[idx_it]``: book-keeping by index equality, the sum a segment sum.

``g_i = sum_t e_{idx_it} delta_it^T`` (one-hot rows), so::

    ||g_i||^2 = sum_{t,s} [idx_it = idx_is] <delta_it, delta_is>      (cost T^2 d)
    S = sum_{i,t} e_{idx_it} (c_i delta_it)^T                          (a segment sum over the indices)

with the index-equality matrix as the input Gram of the ghost norm
(:func:`~sparta_tf.per_example.rules.ghost_norms.gram_squared_norms`, raised past its rounding
error). Per-example gradients (a materialising step, entry selections) come from the per-example
VJP of the layer's call. A unit of several rows (an example's views) is one example on its rows'
merged positions (:mod:`~sparta_tf.per_example.units`).
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.per_example.registry import register_layer_rule
from sparta_tf.per_example.rules.base import GhostRule, NormMethod
from sparta_tf.per_example.rules.ghost_norms import gram_squared_norms
from sparta_tf.per_example.units import ONE_ROW, Units


class EmbeddingGhostRule(GhostRule):
    """Embedding ``z_it = E[idx_it]``: ``g_i = sum_t e_{idx_it} delta_it^T`` (one-hot rows).

    ``||g_i||^2 = sum_{t,s} [idx_it = idx_is] <delta_it, delta_is>`` (index equality, cost ``T^2 d``)
    and ``S = sum_{i,t} e_{idx_it} (c_i delta_it)^T``: a segment sum over the indices.
    """

    def squared_norms(self, layer, call, delta, selections, materialised: dict | None = None):
        return self.unit_squared_norms(layer, call, delta, selections, ONE_ROW, materialised)

    def unit_squared_norms(self, layer, call, delta, selections, units: Units = ONE_ROW,
                           materialised: dict | None = None):
        """Per unit of ``units.rows`` rows: the index equality over the unit's rows' positions merged."""
        if any(s.kind != "dense" for s in selections):  # entries: this layer's per-example gradients
            return self.materialised_norms(layer, call, delta, selections, units, materialised)
        indices, d = self._operands(layer, call, delta)
        indices, d = units.merge(indices[:, :, None])[:, :, 0], units.merge(d)
        same = tf.cast(tf.equal(indices[:, :, None], indices[:, None, :]), d.dtype)  # [U, T, T]
        norms = gram_squared_norms(same, tf.matmul(d, d, transpose_b=True), 2 * tf.shape(d)[1] + d.shape[2])
        positions = d.shape[1]
        cost = None if positions is None else positions * positions * d.shape[2]
        method = units.method("index_equality")
        return norms, [NormMethod(layer.name, variable_key(s.variable), method, cost, None) for s in selections]

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


register_layer_rule(tf.keras.layers.Embedding, EmbeddingGhostRule(), verify=False)
