"""Pixel transforms on ``[N, H, W, C]`` arrays: scaling, channels, resizing."""

from __future__ import annotations

from typing import Optional

import numpy as np

from sparta_tf.data.errors import DataError
from sparta_tf.data.memory import check_fits_in_memory

__all__ = ["convert_channels", "resize_images", "to_unit_float"]

GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)
"""ITU-R 601 luma weights (those of ``tf.image.rgb_to_grayscale``)."""

RESIZE_CHUNK = 2048
"""Images resized per ``tf.image.resize`` call (bounds peak memory)."""


def to_unit_float(x: np.ndarray, what: str) -> np.ndarray:
    """Returns ``x`` as float32 in [0, 1]: integers 0..255 are divided by 255.

    Floats must already lie in [0, 1]; anything else raises a :class:`DataError`.
    """
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
        if x.size and (x.min() < 0 or x.max() > 255):
            raise DataError(f"{what} has integer pixels outside 0..255; store uint8 images")
        return x.astype(np.float32) / np.float32(255.0)
    if np.issubdtype(x.dtype, np.floating):
        if x.size and not (np.isfinite(x).all() and x.min() >= 0.0 and x.max() <= 1.0):
            raise DataError(
                f"{what} has float pixels outside [0, 1]; store uint8 0..255 or floats scaled to [0, 1]"
            )
        return x.astype(np.float32, copy=False)
    raise DataError(f"{what} has dtype {x.dtype}; store images as uint8 or float")


def convert_channels(x: np.ndarray, channels: Optional[int], what: str) -> np.ndarray:
    """Converts grayscale to RGB (replicating) or RGB to grayscale (luma)."""
    have = x.shape[-1]
    if channels is None or channels == have:
        return x
    if have == 1 and channels == 3:
        return np.repeat(x, 3, axis=-1)
    if have == 3 and channels == 1:
        return (x @ GRAY_WEIGHTS)[..., np.newaxis].astype(np.float32)
    raise DataError(
        f"{what} has {have} channels and data.channels is {channels}; "
        "only 1 <-> 3 conversion is supported, remove data.channels"
    )


def resize_images(x: np.ndarray, size: Optional[tuple[int, int]]) -> np.ndarray:
    """Bilinear ``tf.image.resize`` to ``size`` (no-op when already that size); a :class:`DataError` when the
    resized images would not fit in memory (:func:`~sparta_tf.data.memory.check_fits_in_memory`)."""
    if size is None or tuple(x.shape[1:3]) == tuple(size):
        return x
    check_fits_in_memory(4.0 * len(x) * size[0] * size[1] * x.shape[-1], "image_size",
                         f"{list(size)} for {len(x)} images of {x.shape[-1]} channel(s)",
                         "use a smaller data.image_size, or fewer examples (data.limit_train / data.limit_test)")
    import tensorflow as tf

    out = np.empty((len(x), *size, x.shape[-1]), dtype=np.float32)
    for start in range(0, len(x), RESIZE_CHUNK):
        chunk = x[start : start + RESIZE_CHUNK]
        out[start : start + len(chunk)] = tf.image.resize(chunk, size, method="bilinear").numpy()
    return out
