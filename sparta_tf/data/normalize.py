"""Per-channel standardisation with statistics of the training split.

Privacy note: ``normalize: standard`` without explicit ``mean``/``std``
computes the statistics from the (private) training images *without* noise;
that release is not covered by the DP-SGD accounting. For a formal guarantee,
pass ``data.mean`` and ``data.std`` computed on public data (e.g. the public
classes of a transfer setup, or published constants).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from sparta_tf.data.errors import key_error

__all__ = ["MIN_STD", "channel_stats", "fixed_stats", "standardize"]

MIN_STD = 1e-6
"""Standard deviations below this (constant channels) are replaced by 1."""

CHUNK_PIXELS = 1 << 20
"""Pixels per chunk when accumulating statistics in float64."""


def channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation of ``x`` (float64 accumulation)."""
    if len(x) == 0:
        raise key_error("normalize", "the training split is empty", "lower data.val_fraction")
    pixels = x.reshape(-1, x.shape[-1])
    chunks = [pixels[i : i + CHUNK_PIXELS] for i in range(0, len(pixels), CHUNK_PIXELS)]
    mean = sum(_column_sums(chunk) for chunk in chunks) / len(pixels)
    squares = 0.0
    for chunk in chunks:  # second pass around the mean: no cancellation
        centred = chunk - mean.astype(np.float32)
        squares = squares + _column_sums(np.square(centred, out=centred))
    std = np.sqrt(squares / len(pixels))
    std = np.where(std < MIN_STD, 1.0, std)
    return mean.astype(np.float32), std.astype(np.float32)


def _column_sums(rows: np.ndarray) -> np.ndarray:
    """Column sums accumulated in float64 (a BLAS matrix-vector product: fast)."""
    return np.ones(len(rows)) @ rows


def fixed_stats(
    mean: Sequence[float], std: Sequence[float], channels: int
) -> tuple[np.ndarray, np.ndarray]:
    """``mean``/``std`` from the spec as float32 ``[channels]`` arrays."""
    if len(mean) != channels:
        raise key_error("mean", f"has {len(mean)} values but the images have {channels} channels",
                        "give one value per channel")
    return np.asarray(mean, np.float32), np.asarray(std, np.float32)


def standardize(x: np.ndarray, mean: Optional[np.ndarray], std: Optional[np.ndarray]) -> np.ndarray:
    """``(x - mean) / std`` in place (``x`` must be a float32 array this module may modify)."""
    if mean is None:
        return x
    x -= mean
    x /= std
    return x
