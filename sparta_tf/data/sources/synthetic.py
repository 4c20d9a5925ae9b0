"""A learnable synthetic image data set, deterministic by seed.

Class ``k`` has a fixed smooth random pattern ``P_k`` (drawn from the seed's
``synthetic_data`` stream, :mod:`sparta_tf.random_streams`);
an example of class ``k`` is ``clip(0.5 + 0.25 * P_k + 0.1 * noise, 0, 1)``.
Classes are balanced and separable by a linear model, so a few steps of
training must beat chance; useful for smoke tests of the whole pipeline.
"""

from __future__ import annotations

import numpy as np

from sparta_tf import random_streams
from sparta_tf.data.memory import check_fits_in_memory
from sparta_tf.data.raw import ArraySplit, RawData
from sparta_tf.data.spec import DataSpec

__all__ = ["DEFAULT_CHANNELS", "DEFAULT_IMAGE_SIZE", "load_synthetic"]

DEFAULT_IMAGE_SIZE = (8, 8)
DEFAULT_CHANNELS = 3
PATTERN_SCALE = 0.25
NOISE_SCALE = 0.1
GENERATION_BYTES = 20
"""Bytes per pixel value while generating: float64 noise and sum, then the float32 images."""


def load_synthetic(spec: DataSpec, seed: int) -> RawData:
    """``spec.num_examples`` images of ``spec.num_classes`` classes (no test split: carved)."""
    rng = random_streams.numpy_rng(seed, "synthetic_data")
    height, width = spec.image_size or DEFAULT_IMAGE_SIZE
    shape = (height, width, spec.channels or DEFAULT_CHANNELS)
    values = float(spec.num_examples + spec.num_classes) * height * width * shape[2]
    check_fits_in_memory(values * GENERATION_BYTES, "image_size",
                         f"{list(spec.image_size or DEFAULT_IMAGE_SIZE)} for {spec.num_examples} synthetic images of "
                         f"{shape[2]} channel(s)", "use a smaller data.image_size or data.num_examples")
    patterns = _smooth(rng.standard_normal((spec.num_classes, *shape)))
    labels = rng.permutation(np.arange(spec.num_examples) % spec.num_classes).astype(np.int64)
    noise = rng.standard_normal((spec.num_examples, *shape))
    x = np.clip(0.5 + PATTERN_SCALE * patterns[labels] + NOISE_SCALE * noise, 0.0, 1.0)
    names = list(spec.class_names or [f"class_{k}" for k in range(spec.num_classes)])
    return RawData(ArraySplit(x.astype(np.float32), labels), None, names, "synthetic")


def _smooth(patterns: np.ndarray) -> np.ndarray:
    """Averages each pixel with its 4 neighbours (wrapping) and rescales to unit std."""
    total = patterns.copy()
    for axis in (1, 2):
        total += np.roll(patterns, 1, axis=axis) + np.roll(patterns, -1, axis=axis)
    return total / total.std()
