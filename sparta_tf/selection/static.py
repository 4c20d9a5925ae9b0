"""Masks chosen without looking at private data (no privacy cost).

* ``magnitude`` -- MP (Luo et al. 2021; the SPARTA paper's Algorithm 4): per
  layer, the entries (or rows, by L1 norm) of largest ``|W_pretrained|``. The
  pre-trained weights are public, so the mask is free.
* ``random`` -- per layer, uniformly random rows or entries from a seeded
  generator (the paper's "Random-Groups" ablation with rows).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from sparta_tf import random_streams
from sparta_tf.groups import RowGroup
from sparta_tf.selection.scoring import GRANULARITIES
from sparta_tf.selection.topk import selections_from_scores
from sparta_tf.trainable import VariableSelection


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not one of {GRANULARITIES}")


def magnitude_scores(groups: Sequence[RowGroup], granularity: str = "entry") -> list[np.ndarray]:
    """``|W|`` per entry, or ``sum_{k in row} |W_k|`` per row, of the current (pre-trained) weights."""
    _check_granularity(granularity)
    scores = []
    for group in groups:
        magnitude = np.abs(group.variable.numpy())
        if granularity == "row":
            view = magnitude.transpose(group.input_axes + group.output_axes).reshape(group.row_size, group.n_rows)
            magnitude = view.sum(axis=0)
        scores.append(magnitude)
    return scores


def random_scores(groups: Sequence[RowGroup], granularity: str = "row", seed: int = 0) -> list[np.ndarray]:
    """I.i.d. uniform scores (top-k of them is a uniformly random subset per layer), from the
    ``"random_mask"`` stream of ``seed`` (:mod:`sparta_tf.random_streams`)."""
    _check_granularity(granularity)
    rng = random_streams.numpy_rng(seed, "random_mask")
    return [rng.random(g.n_rows if granularity == "row" else g.shape) for g in groups]


def magnitude_selections(
    groups: Sequence[RowGroup], density: float, granularity: str = "entry",
    overrides: Mapping[str, float] | None = None,
) -> list[VariableSelection]:
    return selections_from_scores(groups, magnitude_scores(groups, granularity), density, granularity, overrides)


def random_selections(
    groups: Sequence[RowGroup], density: float, granularity: str = "row", seed: int = 0,
    overrides: Mapping[str, float] | None = None,
) -> list[VariableSelection]:
    return selections_from_scores(groups, random_scores(groups, granularity, seed), density, granularity, overrides)
