"""Per-layer top-k: from scores to trainable selections.

For a layer with ``n`` rows (or entries) and density ``s``, the kept count is
``k = max(1, round(s n))`` when ``s > 0`` and ``0`` when ``s = 0``; the kept
units are the ``k`` largest scores (ties broken by the lower index, so the
result is deterministic). Per-layer overrides map a layer or variable name
pattern (``fnmatch`` syntax, first match wins) to its own density.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping, Sequence

import numpy as np

from sparta_tf import trainable
from sparta_tf.groups import RowGroup


def check_density(density: float, what: str = "density") -> float:
    if not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"{what}={density} must be in [0, 1] (a fraction of each layer's rows)")
    return float(density)


def kept_count(n: int, density: float) -> int:
    """``k = max(1, round(density * n))`` for ``density > 0``, else 0."""
    if density <= 0:
        return 0
    return min(n, max(1, int(round(density * n))))


def density_for(group: RowGroup, density: float, overrides: Mapping[str, float] | None) -> float:
    """The density of ``group``: the first override whose pattern matches its layer or variable name."""
    for pattern, value in (overrides or {}).items():
        if fnmatch.fnmatchcase(group.layer, pattern) or fnmatch.fnmatchcase(group.name, pattern):
            return check_density(value, f"density override {pattern!r}")
    return density


def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Flat indices of the ``k`` largest scores (ties: lower index first), sorted."""
    flat = np.asarray(scores, dtype=np.float64).reshape(-1)
    order = np.argsort(-flat, kind="stable")
    return np.sort(order[:k])


def selections_from_scores(
    groups: Sequence[RowGroup],
    scores: Sequence[np.ndarray],
    density: float,
    granularity: str,
    overrides: Mapping[str, float] | None = None,
) -> list[trainable.VariableSelection]:
    """The top rows (``granularity="row"``) or entries per layer as selections."""
    check_density(density)
    selections = []
    for group, score in zip(groups, scores):
        layer_density = density_for(group, density, overrides)
        if granularity == "row":
            kept = top_indices(score, kept_count(group.n_rows, layer_density))
            selections.append(trainable.rows(group, kept))
        else:
            size = int(np.prod(group.shape))
            mask = np.zeros(size, dtype=bool)
            mask[top_indices(score, kept_count(size, layer_density))] = True
            selections.append(trainable.entries(group.variable, mask.reshape(group.shape)))
    return [s for s in selections if s is not None]
