"""Decoding image files (PNG/JPEG) and collecting ``tf.data`` images into numpy.

Decoding runs in a parallel ``tf.data`` map. Images are returned as float32 in
[0, 1]; when an ``image_size`` is given every image is resized (bilinear) while
decoding, so folders of mixed sizes load as one array.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from sparta_tf.data.errors import DataError

__all__ = ["as_channels", "collect_images", "decode_files", "file_channels"]

BATCH = 256
"""Images decoded per ``tf.data`` batch."""


def file_channels(path: Path) -> int:
    """The channel count to decode ``path`` and its siblings with: 1 or 3 (alpha dropped)."""
    import tensorflow as tf

    try:
        native = int(tf.io.decode_image(tf.io.read_file(str(path)), expand_animations=False).shape[-1])
    except tf.errors.OpError as error:
        problem = _first_line(error)
        raise DataError(f"cannot decode image {path}: {problem}; remove or fix the file") from None
    return 1 if native in (1, 2) else 3


def decode_files(
    paths: Sequence[str], channels: int, image_size: Optional[tuple[int, int]]
) -> np.ndarray:
    """Decodes ``paths`` into a float32 ``[N, H, W, channels]`` array in [0, 1]."""
    import tensorflow as tf

    def load(path: tf.Tensor) -> tf.Tensor:
        image = tf.io.decode_image(tf.io.read_file(path), expand_animations=False)  # its own channels
        image = as_channels(tf.image.convert_image_dtype(image, tf.float32), channels)
        if image_size is not None:
            image = tf.image.resize(image, image_size, method="bilinear")
        return image

    names = list(paths)
    files = tf.data.Dataset.from_tensor_slices(tf.constant(names, tf.string))
    images = files.map(load, num_parallel_calls=tf.data.AUTOTUNE)
    try:  # fast path: equal sizes batch together
        batches = list(images.batch(BATCH).as_numpy_iterator())
    except tf.errors.OpError:  # a bad file or mixed sizes: find and name it
        return collect_images(images, names, channels)
    if not batches:
        return np.zeros((0, *(image_size or (1, 1)), channels), np.float32)
    return np.concatenate(batches)


def as_channels(image, channels: int):
    """One decoded image ``[H, W, c]`` (float, any ``c``: gray, gray + alpha, RGB, RGBA) as ``channels`` (1 or
    3), converted on its own as :func:`~sparta_tf.data.images.convert_channels` converts arrays: gray
    replicated to RGB, RGB to gray by :data:`~sparta_tf.data.images.GRAY_WEIGHTS`, alpha dropped. Every file
    is converted from its own channels, so no other file's channels change its pixels."""
    import tensorflow as tf

    from sparta_tf.data.images import GRAY_WEIGHTS

    colour = tf.shape(image)[-1] >= 3
    if channels == 1:
        luma = lambda: tf.tensordot(image[..., :3], tf.constant(GRAY_WEIGHTS), axes=1)[..., None]
        out = tf.cond(colour, luma, lambda: image[..., :1])
    else:
        out = tf.cond(colour, lambda: image[..., :3], lambda: tf.tile(image[..., :1], [1, 1, 3]))
    return tf.ensure_shape(out, [None, None, channels])


def collect_images(images, names: Sequence[str], channels: int) -> np.ndarray:
    """Stacks a ``tf.data`` stream of ``[H, W, C]`` images one by one, naming the
    first file that fails to decode or whose size differs from the first image's."""
    import tensorflow as tf

    out: list[np.ndarray] = []
    iterator = iter(images.as_numpy_iterator())
    while True:
        try:
            image = next(iterator)
        except StopIteration:
            break
        except tf.errors.OpError as error:
            name = names[len(out)] if len(out) < len(names) else "an image"
            raise DataError(f"cannot decode {name}: {_first_line(error)}; remove or fix the file") from None
        if out and image.shape != out[0].shape:
            raise DataError(
                f"images differ in size ({names[0]} is {out[0].shape[:2]}, {names[len(out)]} is "
                f"{image.shape[:2]}); set data.image_size to resize them, e.g. [32, 32]"
            )
        out.append(image)
    if not out:
        return np.zeros((0, 1, 1, channels), np.float32)
    return np.stack(out).astype(np.float32, copy=False)


def _first_line(error: BaseException) -> str:
    text = getattr(error, "message", None) or str(error)
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
