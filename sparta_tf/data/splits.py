"""Deterministic, stratified index selection (validation/test splits and limits).

All choices depend only on the labels and a generator of one of the data
streams of :mod:`sparta_tf.random_streams` (``test_split``, ``limit_train``,
``limit_test``, ``val_split``; one stream per purpose), so the same spec and
seed give the same split on every machine, and changing ``limit_train``
never changes the test split.
"""

from __future__ import annotations

import numpy as np

__all__ = ["fraction_count", "stratified_take"]


def fraction_count(total: int, fraction: float) -> int:
    """``round(fraction * total)`` with halves rounded up."""
    return int(np.floor(fraction * total + 0.5))


def stratified_take(
    labels: np.ndarray, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Splits positions ``0 .. len(labels) - 1`` into ``(taken, rest)``.

    ``taken`` holds exactly ``min(count, len(labels))`` positions; each class
    contributes in proportion to its size (largest-remainder rounding, ties to
    the smaller class id). Both arrays are in a random (seeded) order.
    """
    total = len(labels)
    count = min(max(count, 0), total)
    order = rng.permutation(total)
    if total == 0:
        return order, order
    _, inverse = np.unique(labels, return_inverse=True)
    quota = _class_quota(np.bincount(inverse), count)
    ordered_class = inverse[order]
    by_class = np.argsort(ordered_class, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(inverse))[:-1]])
    rank = np.empty(total, dtype=np.int64)
    rank[by_class] = np.arange(total) - starts[ordered_class[by_class]]
    picked = rank < quota[ordered_class]
    return order[picked], order[~picked]


def _class_quota(sizes: np.ndarray, count: int) -> np.ndarray:
    """Per-class counts summing to ``count``, proportional to ``sizes``."""
    exact = sizes * (count / sizes.sum())
    quota = np.floor(exact).astype(np.int64)
    short = count - int(quota.sum())
    by_remainder = np.argsort(-(exact - quota), kind="stable")
    quota[by_remainder[:short]] += 1
    return np.minimum(quota, sizes)
