"""Trainable sets: which coordinates of which variables DP-SGD updates.

A :class:`TrainableSet` is a list of :class:`VariableSelection`, one per
variable that receives updates. A selection is one of

* ``dense`` -- every coordinate of the variable (biases, norms, the head,
  or every weight for ``all``);
* ``rows`` -- the rows (output units, see :mod:`sparta_tf.groups`) ``r_1 <
  ... < r_k`` of a kernel. Its *compact* form is the row-view block
  ``R(W)[:, rows]`` of shape ``[fan_in, k]``;
* ``entries`` -- an arbitrary set of coordinates (flat indices ``e_1 < ... <
  e_k``), compact form ``[k]``.

Per-example gradients, clipping norms, noise and optimizer state all live in
the compact form, so their cost is proportional to the number of trainable
coordinates, and frozen coordinates are never read or written: the optimizer
writes compact updates back with ``scatter_nd_sub`` at ``flat_indices``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Sequence

import numpy as np
import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.groups import RowGroup

KINDS = ("dense", "rows", "entries")


@dataclasses.dataclass(frozen=True, eq=False)
class VariableSelection:
    """The trainable coordinates of one variable.

    ``learning_rate_scale`` multiplies the optimizer's learning rate for this
    variable (e.g. a larger rate for a freshly initialised head).
    """

    variable: tf.Variable
    kind: str = "dense"
    rows: np.ndarray | None = None
    entries: np.ndarray | None = None
    group: RowGroup | None = None
    learning_rate_scale: float = 1.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"selection kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "rows" and (self.group is None or self.rows is None):
            raise ValueError("a rows selection needs its RowGroup and row indices")
        if self.kind == "entries" and self.entries is None:
            raise ValueError("an entries selection needs its flat indices")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.variable.shape.as_list())

    @property
    def compact_shape(self) -> tuple[int, ...]:
        if self.kind == "rows":
            return (self.group.row_size, len(self.rows))
        if self.kind == "entries":
            return (len(self.entries),)
        return self.shape

    @property
    def size(self) -> int:
        """Number of trainable coordinates."""
        return int(np.prod(self.compact_shape))

    @functools.cached_property
    def flat_indices(self) -> np.ndarray | None:
        """Flat indices into the variable, in compact (row-major) order; None when dense."""
        if self.kind == "rows":
            return self.group.row_flat_indices(self.rows)
        if self.kind == "entries":
            return self.entries
        return None

    def compact(self, full: tf.Tensor, batch_dims: int = 0) -> tf.Tensor:
        """``[*batch, *shape] -> [*batch, *compact_shape]`` (gathers the trainable coordinates)."""
        if self.kind == "dense":
            return full
        batch_shape = tf.shape(full)[:batch_dims]
        flat = tf.reshape(full, tf.concat([batch_shape, [-1]], 0))
        picked = tf.gather(flat, self.flat_indices, axis=batch_dims)
        return tf.reshape(picked, tf.concat([batch_shape, self.compact_shape], 0))

    def dense_mask(self) -> np.ndarray:
        """Boolean array of the variable's shape: True on trainable coordinates."""
        mask = np.zeros(int(np.prod(self.shape)), dtype=bool)
        indices = self.flat_indices
        mask[slice(None) if indices is None else indices] = True
        return mask.reshape(self.shape)


def dense(variable: tf.Variable, learning_rate_scale: float = 1.0) -> VariableSelection:
    return VariableSelection(variable, "dense", learning_rate_scale=learning_rate_scale)


def rows(group: RowGroup, selected: Iterable[int], learning_rate_scale: float = 1.0) -> VariableSelection | None:
    """Rows ``selected`` of ``group``'s kernel (None when empty, dense when all)."""
    selected = np.unique(np.asarray(list(selected), dtype=np.int64))
    if selected.size and (selected[0] < 0 or selected[-1] >= group.n_rows):
        raise ValueError(f"row indices out of range [0, {group.n_rows}) for {group.name}")
    if selected.size == 0:
        return None
    if selected.size == group.n_rows:
        return VariableSelection(group.variable, "dense", group=group, learning_rate_scale=learning_rate_scale)
    return VariableSelection(group.variable, "rows", rows=selected, group=group, learning_rate_scale=learning_rate_scale)


def entries(variable: tf.Variable, mask: np.ndarray, learning_rate_scale: float = 1.0) -> VariableSelection | None:
    """Coordinates where boolean ``mask`` (the variable's shape) is True (None when empty)."""
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != tuple(variable.shape.as_list()):
        raise ValueError(f"mask shape {mask.shape} != variable shape {tuple(variable.shape.as_list())} "
                         f"({variable_key(variable)})")
    flat = np.flatnonzero(mask.reshape(-1)).astype(np.int64)
    if flat.size == 0:
        return None
    if flat.size == mask.size:
        return VariableSelection(variable, "dense", learning_rate_scale=learning_rate_scale)
    return VariableSelection(variable, "entries", entries=flat, learning_rate_scale=learning_rate_scale)


class TrainableSet:
    """An ordered list of selections, at most one per variable."""

    def __init__(self, selections: Sequence[VariableSelection | None]):
        self.selections = [s for s in selections if s is not None]
        seen = set()
        for s in self.selections:
            if id(s.variable) in seen:
                raise ValueError(f"variable {variable_key(s.variable)} selected twice")
            seen.add(id(s.variable))
        if not self.selections:
            raise ValueError("the trainable set is empty: select at least one variable")

    @classmethod
    def of_variables(cls, variables: Sequence[tf.Variable]) -> "TrainableSet":
        return cls([dense(v) for v in variables])

    def __iter__(self):
        return iter(self.selections)

    def __len__(self) -> int:
        return len(self.selections)

    @property
    def variables(self) -> list[tf.Variable]:
        return [s.variable for s in self.selections]

    @property
    def size(self) -> int:
        """Number of trainable coordinates."""
        return sum(s.size for s in self.selections)

    def fraction_of(self, model: tf.keras.Model) -> float:
        """Trainable coordinates / all trainable-variable coordinates of ``model``."""
        total = sum(int(np.prod(v.shape.as_list())) for v in model.trainable_variables)
        return self.size / total

    def selection_for(self, variable: tf.Variable) -> VariableSelection | None:
        for s in self.selections:
            if s.variable is variable:
                return s
        return None

    def signature(self) -> tuple:
        """Hashable description (kinds, sizes): equal signatures share traced graphs."""
        return tuple((variable_key(s.variable), s.kind, s.size) for s in self.selections)

    def union(self, other: "TrainableSet") -> "TrainableSet":
        """This set plus the selections of ``other`` whose variables are not in it yet."""
        mine = {id(s.variable) for s in self.selections}
        return TrainableSet(self.selections + [s for s in other if id(s.variable) not in mine])
