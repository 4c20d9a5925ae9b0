"""Image augmentation (random flip + random shift) for NON-private pre-training only.

Augmentation during DP training is **not supported**: ``DPModel.fit`` draws
Poisson-sampled batches from fixed arrays, and the privacy accounting assumes
each example contributes one clipped gradient per step; augmented views (or
augmentation multiplicity) would need their own per-example treatment, which
this library does not implement. Use these functions only for non-private
pre-training on public data, e.g.::

    augmenter = make_augmenter(seed=0)
    train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).batch(128)
    train = train.map(lambda xb, yb: (augmenter(xb, training=True), yb))
    model.fit(train, epochs=...)

The pipeline is built from ``tf.keras.layers`` preprocessing layers (no
downloads, no presets). Called with ``training=False`` it is the identity.
"""

from __future__ import annotations

import numpy as np

from sparta_tf import random_streams
from sparta_tf.data.errors import DataError

__all__ = ["augment", "make_augmenter"]

DEFAULT_MAX_SHIFT = 0.125
"""Largest shift as a fraction of height/width (4 px on 32x32, like pad-4-and-crop)."""

CHUNK = 4096


def make_augmenter(*, flip: bool = True, max_shift: float = DEFAULT_MAX_SHIFT, seed: int = 0):
    """A ``tf.keras.Sequential`` of random horizontal flip and random translation.

    Shifts are whole pixels (nearest interpolation) up to ``max_shift`` of the
    image size, filled by reflection: the Keras equivalent of "pad and random
    crop". Turn ``flip`` off for data whose classes are not mirror-invariant
    (digits, text). The layers' seeds come from the ``augmentation`` stream of
    ``seed`` (:mod:`sparta_tf.random_streams`): two augmenters with the same
    ``seed`` produce the same sequence of random draws; successive calls of one
    augmenter differ.
    """
    import tensorflow as tf

    if not 0.0 <= max_shift < 1.0:
        raise DataError(f"max_shift must be in [0, 1), got {max_shift!r}; use e.g. 0.125")
    flip_seed, shift_seed = random_streams.int_seeds(seed, "augmentation", 2)
    layers = []
    if flip:
        layers.append(tf.keras.layers.RandomFlip("horizontal", seed=flip_seed))
    if max_shift > 0:
        layers.append(
            tf.keras.layers.RandomTranslation(
                max_shift, max_shift, fill_mode="reflect", interpolation="nearest", seed=shift_seed
            )
        )
    return tf.keras.Sequential(layers, name="augment")


def augment(
    x: np.ndarray, *, seed: int = 0, flip: bool = True, max_shift: float = DEFAULT_MAX_SHIFT
) -> np.ndarray:
    """One augmented copy of the images ``x`` (``[N, H, W, C]``), deterministic by ``seed``."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 4:
        raise DataError(
            f"augment expects images of shape [N, H, W, C], got {x.shape}; add the missing axes"
        )
    augmenter = make_augmenter(flip=flip, max_shift=max_shift, seed=seed)
    if not augmenter.layers:
        return x.copy()
    out = np.empty_like(x)
    for start in range(0, len(x), CHUNK):
        out[start : start + CHUNK] = augmenter(x[start : start + CHUNK], training=True).numpy()
    return out
