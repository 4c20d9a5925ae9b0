"""Per-example views of a recorded layer call's arguments.

A rule that re-runs a layer one example at a time (the per-example VJP of
:class:`~sparta_tf.per_example.rules.base.VjpRule`) must give example ``i``
only its own data. Every tensor argument with a batch dimension, positional or
keyword (``mask=``, ``attention_mask=``, initial states), also inside lists,
tuples and dicts, is sliced to row ``i``; arguments without one (Python
values, scalars, tensors shared by every example) are passed whole.

Why it matters: a whole-batch ``mask`` passed to example ``i``'s re-run
broadcasts against the other rows, so ``i``'s clipped contribution becomes a
function of other examples' data, padding rows included. It is still clipped
to ``C``, but the (epsilon, delta) analysis assumes each term is a function of
one example only.

A tensor has a batch dimension when its leading dimension is the call's number
of rows (the leading dimension of the layer's output). When the rows are
unknown when the step is traced, a leading dimension that is also unknown
counts as the batch; a static one is taken as shared, and a run-time check
refuses the step should it equal the rows after all.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import tensorflow as tf

from sparta_tf.per_example.errors import UnsupportedLayerError


class SplitArguments(NamedTuple):
    """``batched``: the tensors to slice per example (for ``tf.vectorized_map``);
    ``rebuild(rows)``: the call's ``(args, kwargs)`` with ``rows[k]`` in place of ``batched[k]``."""

    batched: list
    rebuild: Callable[[list], tuple[tuple, dict]]
    checks: list


def _is_batched(t: Any, rows: int | None, layer_name: str) -> bool:
    if isinstance(t, (tf.SparseTensor, tf.RaggedTensor)):
        raise UnsupportedLayerError(
            f"layer {layer_name!r} takes a {type(t).__name__} argument, which per-example re-runs "
            "cannot slice by example; pass a dense tensor (with a mask) instead")
    if not isinstance(t, tf.Tensor) or t.shape.rank is None or t.shape.rank == 0:
        return False
    leading = t.shape[0]
    if rows is not None and leading is not None:
        return leading == rows
    return leading is None


def split_arguments(layer_name: str, args: tuple, kwargs: dict, rows: int | None,
                    dynamic_rows: tf.Tensor) -> SplitArguments:
    """Splits a call's arguments into per-example tensors and a rebuild function (see module doc).

    ``rows``: the static number of rows of the call (None when unknown); ``dynamic_rows``: the
    number at run time. ``checks``: run-time assertions that a tensor taken as shared does not
    have ``dynamic_rows`` rows (run them before the re-run).
    """
    leaves = tf.nest.flatten((args, kwargs), expand_composites=False)
    positions, batched, checks = [], [], []
    for position, leaf in enumerate(leaves):
        if _is_batched(leaf, rows, layer_name):
            positions.append(position)
            batched.append(leaf)
        elif rows is None and isinstance(leaf, tf.Tensor) and leaf.shape.rank:
            checks.append(tf.debugging.assert_none_equal(
                tf.shape(leaf)[0], tf.cast(dynamic_rows, tf.int32),
                message=f"layer {layer_name!r}: an argument of static length {leaf.shape[0]} has one row "
                "per example; give it an unknown (None) batch dimension so that per-example re-runs slice it"))

    def rebuild(per_example: list) -> tuple[tuple, dict]:
        new = list(leaves)
        for position, value in zip(positions, per_example):
            new[position] = value
        return tf.nest.pack_sequence_as((args, kwargs), new)

    return SplitArguments(batched, rebuild, checks)
