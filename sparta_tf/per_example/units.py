"""Units: several consecutive rows of a batch whose gradients are summed and clipped as one.

A *unit* is what one clip factor covers. With augmentation multiplicity (``views = K``,
:mod:`sparta_tf.dp_step.views`) a unit is one example's ``K`` view rows (row ``u K + k`` is view
``k`` of example ``u``); with user-level DP it would be one user's rows. A unit's gradient is the sum
of its rows' gradients, ``g_u = sum_{r in u} g_r``, and is clipped once: ``c_u = min(1, C/||g_u||)``.

For a linear map ``g_r = sum_t a_{r,t}^T delta_{r,t}`` (Dense, Dense-like EinsumDense, a convolution
on its im2col patches, an embedding on its one-hot rows) the unit's gradient is::

    g_u = sum_{r in u} sum_t a_{r,t}^T delta_{r,t}

the gradient of *one* example whose ``k T`` positions are the unit's rows' positions. So the
operands ``a: [R, T, in]``, ``delta: [R, T, out]`` of ``R = U k`` rows, reshaped to
``[U, k T, in]`` and ``[U, k T, out]`` (:meth:`Units.merge`; the rows of a unit are consecutive),
give ``||g_u||^2`` exactly by the ghost norm or the direct per-unit gradient
(:mod:`~sparta_tf.per_example.rules.ghost_norms`, with ``k T`` positions: rank one no longer
applies for ``k > 1`` on 2-D input). Any other variable's per-row gradients are summed per unit
(:meth:`Units.sum`) and reduced to norms, which is exact for any layer.

The clipped sum ``sum_u c_u g_u = sum_r c_{u(r)} g_r`` needs nothing per unit: it is the rules'
row-level sum with each row's output gradient scaled by its unit's factor
(:meth:`Units.repeat`), exactly zero for the rows of a unit that is not kept.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

Tensor = tf.Tensor


class Units(NamedTuple):
    """``rows`` consecutive rows per unit; ``name`` suffixes the cost table's norm methods
    (``"ghost"`` becomes ``"ghost_views"``) so that it says the norms were taken per unit."""

    rows: int = 1
    name: str = ""

    def method(self, name: str) -> str:
        """The cost table's name of a norm ``name`` taken per unit."""
        return name if self.rows == 1 or not self.name else f"{name}_{self.name}"

    def positions(self, per_row: int | None) -> int | None:
        """A unit's positions, ``rows x per_row`` (None when ``per_row`` is unknown)."""
        return None if per_row is None else self.rows * per_row

    def merge(self, t: Tensor) -> Tensor:
        """``[R, T, C] -> [R / rows, rows T, C]``: a unit's rows' positions as one example's."""
        if self.rows == 1:
            return t
        positions = self.positions(t.shape[1])
        shape = [-1, positions if positions is not None else self.rows * tf.shape(t)[1], _last(t)]
        return tf.reshape(t, shape)

    def sum(self, t: Tensor) -> Tensor:
        """``[R, ...] -> [R / rows, ...]``: per-row gradients summed per unit."""
        if self.rows == 1:
            return t
        grouped = tf.reshape(t, tf.concat([[-1, self.rows], tf.shape(t)[1:]], 0))
        summed = tf.reduce_sum(grouped, axis=1)
        if t.shape.rank is not None:
            summed.set_shape([None, *t.shape[1:]])
        return summed

    def repeat(self, per_unit: Tensor) -> Tensor:
        """``[U, ...] -> [U rows, ...]``: each unit's entry (clip factor, kept or not) on its rows."""
        return per_unit if self.rows == 1 else tf.repeat(per_unit, self.rows, axis=0)

    def units_of(self, rows: Tensor) -> Tensor:
        """The number of units in ``rows`` rows (a scalar tensor)."""
        return rows if self.rows == 1 else rows // self.rows


ONE_ROW = Units()
"""One row per unit: the ordinary per-example step."""


def view_units(views: int) -> Units:
    """The units of augmentation multiplicity: an example's ``views`` rows."""
    return ONE_ROW if views == 1 else Units(views, "views")


def _last(t: Tensor):
    return t.shape[-1] if t.shape[-1] is not None else tf.shape(t)[-1]
