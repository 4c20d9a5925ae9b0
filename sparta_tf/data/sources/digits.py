"""scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download)."""

from __future__ import annotations

import numpy as np

from sparta_tf.data.raw import ArraySplit, RawData
from sparta_tf.data.spec import DataSpec

__all__ = ["load_digits_source"]

DIGITS_MAX = 16.0
"""Pixel values of ``load_digits`` are integers 0..16."""


def load_digits_source(spec: DataSpec, seed: int) -> RawData:
    """The digits as ``[1797, 8, 8, 1]`` floats in [0, 1] (no test split: carved)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / DIGITS_MAX).astype(np.float32)[..., np.newaxis]
    y = digits.target.astype(np.int64)
    names = [str(k) for k in range(10)]
    return RawData(ArraySplit(x, y), None, names, "digits")
