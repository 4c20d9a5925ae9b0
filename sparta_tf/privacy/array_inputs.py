"""Checks and conversions of the in-memory arrays the DP input pipelines sample from.

Every leaf of ``x`` and ``y`` (arrays, tensors, or nests of them) holds the
examples along axis 0; the pipelines convert them once to host tensors and
gather ``k * P`` rows per element.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["check_positive_int", "check_sample_rate", "check_start_step", "examples_fingerprint", "gather_rows",
           "leading_dim", "num_examples", "to_host_tensors"]


def check_sample_rate(sample_rate: Any) -> float:
    """``q`` as a float in ``(0, 1]``; ValueError naming the fix otherwise."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Real):
        raise ValueError(
            f"sample_rate must be a real number in (0, 1], got {sample_rate!r}; "
            "pass e.g. expected_batch_size / n."
        )
    q = float(sample_rate)
    if not (0.0 < q <= 1.0):  # also rejects nan
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate!r}; "
            "pass e.g. expected_batch_size / n."
        )
    return q


def check_positive_int(value: Any, name: str, fix: str) -> int:
    """``value`` as an int ``>= 1``; ValueError with ``fix`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}; {fix}.")
    return int(value)


def check_extra_participants(extra: Any) -> int:
    """``extra`` participants without rows (a white-box audit's canaries), an int ``>= 0``."""
    if isinstance(extra, bool) or not isinstance(extra, numbers.Integral) or extra < 0:
        raise ValueError(f"extra={extra!r} must be an integer >= 0 (participants without rows)")
    return int(extra)


def check_start_step(start_step: Any) -> int:
    """The global step a pipeline starts at, an int ``>= 0``."""
    if (
        isinstance(start_step, bool)
        or not isinstance(start_step, numbers.Integral)
        or start_step < 0
    ):
        raise ValueError(
            f"start_step must be an integer >= 0, got {start_step!r}; pass the "
            "number of logical steps already taken (e.g. optimizer.iterations)."
        )
    return int(start_step)


def leading_dim(leaf: Any) -> int | None:
    """The length of axis 0 of ``leaf`` (None for a scalar or an unknown length)."""
    shape = getattr(leaf, "shape", None)
    if shape is None:
        shape = np.shape(leaf)
    if len(shape) == 0:
        return None
    dim = shape[0]
    return None if dim is None else int(dim)


def num_examples(x: Any, y: Any) -> int:
    """Number of examples shared by every leaf of ``x`` and ``y``."""
    sizes = {}
    for name, nest in (("x", x), ("y", y)):
        leaves = tf.nest.flatten(nest)
        if not leaves or any(leaf is None for leaf in leaves):
            raise ValueError(
                f"{name} must be an array, tensor or nest of them, got {nest!r}; "
                "pass in-memory data with examples along axis 0."
            )
        for leaf in leaves:
            dim = leading_dim(leaf)
            if dim is None:
                raise ValueError(
                    f"every leaf of {name} needs a known leading (example) axis, got "
                    f"shape {getattr(leaf, 'shape', np.shape(leaf))}; reshape to [n, ...]."
                )
            sizes.setdefault(name, set()).add(dim)
    if len(sizes["x"]) > 1:
        raise ValueError(
            f"leaves of x have different lengths {sorted(sizes['x'])}; "
            "give every feature the same number of examples."
        )
    if len(sizes["y"]) > 1:
        raise ValueError(
            f"leaves of y have different lengths {sorted(sizes['y'])}; "
            "give every label array the same number of examples."
        )
    (n_x,), (n_y,) = sizes["x"], sizes["y"]
    if n_x != n_y:
        raise ValueError(
            f"x has {n_x} examples but y has {n_y}; pass one label per example."
        )
    if n_x == 0:
        raise ValueError("x and y have 0 examples; pass a non-empty data set.")
    return n_x


def to_host_tensors(nest: Any) -> Any:
    """Converts every leaf to a tensor on the host CPU (where tf.data runs)."""
    with tf.device("/cpu:0"):
        return tf.nest.map_structure(tf.convert_to_tensor, nest)


def gather_rows(nest: Any, indices: tf.Tensor) -> Any:
    """Rows ``indices`` of every leaf of ``nest``."""
    return tf.nest.map_structure(lambda a: tf.gather(a, indices, axis=0), nest)


def examples_fingerprint(x: Any, y: Any) -> str:
    """A BLAKE2b digest of every leaf of ``x`` and ``y`` (values, dtypes, shapes, in nest order): equal for
    the same examples in the same order, different (but for a collision) otherwise. A secret of the run, as
    the data are: kept in memory and in the run's checkpoints, never in what a run releases."""
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    for leaf in tf.nest.flatten((x, y)):
        array = leaf.numpy() if isinstance(leaf, tf.Tensor) else np.asarray(leaf)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(repr(array.tolist()).encode() if array.dtype.kind == "O" else np.ascontiguousarray(array).data)
    return digest.hexdigest()
