"""Random views of examples for augmentation multiplicity (:mod:`sparta_tf.dp_step.views`).

A *view augmentation* maps a batch of ``N`` example rows and one stateless random key (int64
``[2]``, from the run's ``augmult`` stream: :mod:`sparta_tf.random_streams`) to ``N`` augmented
rows of the same shape and dtype, each row drawn independently::

    A(v_1..v_N; key) = (a(v_1; xi_1), ..., a(v_N; xi_N)),   xi_j from key

Three kinds are accepted (:func:`view_augmentation`):

* the default :class:`FlipAndCrop` for images ``[N, H, W, C]``: random horizontal flip and a
  random crop of the image padded by ``pad`` pixels (reflection), the "pad-and-crop" of the DP
  image-classification literature;
* a function of one example and a seed, ``fn(x_j, seed_j) -> x_j'`` (``seed_j``: int64 ``[2]`` for
  TensorFlow's ``tf.random.stateless_*`` / ``tf.image.stateless_random_*`` ops), vectorised over
  the rows (:class:`ExampleFunction`);
* a Keras layer, e.g. a ``Sequential`` of preprocessing layers (``RandomFlip``,
  ``RandomTranslation``, ...), called with ``training=True`` on one row at a time
  (:class:`KerasLayerViews`). Its randomness is the layer's own generator, not the run's stream:
  seed the layers yourself for reproducible views.

No augmentation may mix rows (each view must depend on its own example only): the privacy
analysis needs every view of example ``i`` to be a function of ``x_i`` alone. The first two kinds
see one example by construction (the default computes each row from that row; a function gets one
example). A Keras layer could see the whole batch (a layer that standardises by the batch's
statistics would let one example move every other example's views, so every clipped term), so it
gets a batch of one row, row after row; and a layer that writes a floating-point variable in a
call (a moving statistic of the data) is refused before the first step.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import tensorflow as tf

DEFAULT_PAD = 4
"""Pixels of padding before the random crop (4 on 32x32 images: shifts of up to 12.5%)."""


class ViewAugmentation(Protocol):
    """``(rows [N, ...], key int64 [2]) -> rows [N, ...]``, each row augmented independently."""

    def __call__(self, rows, key: tf.Tensor): ...


class FlipAndCrop:
    """Per image ``x [H, W, C]``: ``x' = crop_{dy, dx}(pad_p(flip_f(x)))`` with ``f ~ Bernoulli(1/2)``
    (when ``flip``), ``dy, dx ~ U{0, ..., 2p}`` and ``pad_p`` the reflection padding by ``p = pad``
    pixels: a shift by up to ``p`` pixels in each direction, reflected at the borders. Batched
    gathers, no per-image loop (XLA-friendly). Turn ``flip`` off for data whose classes are not
    mirror-invariant (digits, text)."""

    def __init__(self, flip: bool = True, pad: int = DEFAULT_PAD):
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise ValueError(f"augmentation pad={pad!r} must be an integer >= 0 (pixels); use e.g. 4")
        if not isinstance(flip, bool):
            raise ValueError(f"augmentation flip={flip!r} must be true or false")
        self.flip = flip
        self.pad = pad

    def __repr__(self) -> str:
        return f"FlipAndCrop(flip={self.flip}, pad={self.pad})"

    def check(self, rows) -> None:
        """A ValueError (one line) unless ``rows`` are images ``[N, H, W, C]`` larger than ``pad``."""
        shape = getattr(rows, "shape", None)
        if isinstance(rows, (dict, list, tuple)) or shape is None or len(shape) != 4:
            raise ValueError(
                f"the default augmentation (random flip + pad-and-crop) needs images [N, H, W, C], got inputs "
                f"of shape {None if shape is None else tuple(shape)}; pass augmentation= (a Keras layer or a "
                "function fn(x, seed) of one example)")
        height, width = shape[1], shape[2]
        if height is not None and width is not None and self.pad >= min(height, width):
            raise ValueError(f"augmentation pad={self.pad} must be smaller than the {height}x{width} images")

    def __call__(self, rows, key):
        images = tf.convert_to_tensor(rows)
        count = tf.shape(images)[0]
        flip_key, row_key, col_key = tf.unstack(tf.random.experimental.stateless_split(key, 3))
        if self.flip:
            flipped = tf.random.stateless_uniform([count], flip_key) < 0.5
            images = tf.where(flipped[:, None, None, None], tf.reverse(images, axis=[2]), images)
        if self.pad == 0:
            return images
        p = self.pad
        padded = tf.pad(images, [[0, 0], [p, p], [p, p], [0, 0]], mode="REFLECT")
        dy = tf.random.stateless_uniform([count], row_key, minval=0, maxval=2 * p + 1, dtype=tf.int32)
        dx = tf.random.stateless_uniform([count], col_key, minval=0, maxval=2 * p + 1, dtype=tf.int32)
        rows_index = dy[:, None] + tf.range(tf.shape(images)[1])[None, :]
        cols_index = dx[:, None] + tf.range(tf.shape(images)[2])[None, :]
        cropped = tf.gather(padded, rows_index, axis=1, batch_dims=1)
        cropped = tf.gather(cropped, cols_index, axis=2, batch_dims=1)
        cropped.set_shape(rows.shape if hasattr(rows, "shape") else None)
        return cropped


class ExampleFunction:
    """A user function of one example and its seed, ``fn(x_j, seed_j)``, over ``N`` rows: ``seed_j``
    (int64 ``[2]``) drawn from ``key``, the rows through ``tf.vectorized_map`` (a while loop for the
    ops it cannot vectorise)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __repr__(self) -> str:
        return f"ExampleFunction({getattr(self.fn, '__name__', self.fn)!r})"

    def check(self, rows) -> None:
        """Nothing to check before the first call (the call itself is checked for shapes)."""

    def __call__(self, rows, key):
        count = tf.shape(tf.nest.flatten(rows)[0])[0]
        seeds = tf.random.stateless_uniform([count, 2], key, minval=None, maxval=None, dtype=tf.int64)
        return tf.vectorized_map(lambda pair: self.fn(pair[0], pair[1]), (rows, seeds))


class KerasLayerViews:
    """A Keras layer (e.g. preprocessing layers) applied with ``training=True`` to a batch of one row,
    for every row in turn (``tf.map_fn``), so that no view can depend on another example (module doc);
    the key is unused: the layer draws from its own generator."""

    def __init__(self, layer):
        self.layer = layer

    def __repr__(self) -> str:
        return f"KerasLayerViews({self.layer.name!r})"

    def check(self, rows) -> None:
        """A ValueError (one line) when a call writes a floating-point variable of the layer (a statistic
        of the rows it saw, carried to later rows and steps outside the clipped update); the random
        generators' integer states may change. A first call builds the layer; the second is compared,
        and every variable is then restored to what the first left."""
        rows = tf.nest.map_structure(tf.convert_to_tensor, rows)
        self(rows, None)
        snapshot = [(v, v.numpy()) for v in self.layer.variables]
        try:
            self(rows, None)
            written = [v.name for v, before in snapshot
                       if tf.as_dtype(v.dtype).is_floating and not np.array_equal(v.numpy(), before)]
        finally:
            for variable, value in snapshot:
                variable.assign(value)
        if written:
            raise ValueError(f"augmentation {self!r} writes the variables {written[:3]} when it draws views: it "
                             "carries statistics of the private examples to other examples and steps; use "
                             "preprocessing layers without state (or a function fn(x, seed) of one example)")

    def __call__(self, rows, key):
        def one_row(row):
            return tf.nest.map_structure(lambda t: t[0], self.layer(
                tf.nest.map_structure(lambda t: t[None], row), training=True))

        signature = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), rows)
        return tf.map_fn(one_row, rows, fn_output_signature=signature)


def view_augmentation(augmentation) -> ViewAugmentation:
    """The view augmentation of ``augmentation``: None -> :class:`FlipAndCrop` (flip, pad 4); a dict
    -> ``FlipAndCrop(**dict)``; a Keras layer -> :class:`KerasLayerViews`; any other callable -> a
    function of one example and its seed (:class:`ExampleFunction`); one of these classes as is."""
    if augmentation is None:
        return FlipAndCrop()
    if isinstance(augmentation, (FlipAndCrop, ExampleFunction, KerasLayerViews)):
        return augmentation
    if isinstance(augmentation, dict):
        unknown = sorted(set(augmentation) - {"flip", "pad"})
        if unknown:
            raise ValueError(f"unknown augmentation option(s) {unknown}; the default augmentation takes flip and pad")
        return FlipAndCrop(**augmentation)
    if isinstance(augmentation, tf.keras.layers.Layer) or _is_keras_layer(augmentation):
        return KerasLayerViews(augmentation)
    if callable(augmentation):
        return ExampleFunction(augmentation)
    raise ValueError(f"augmentation={augmentation!r} is not a Keras layer, a function fn(x, seed) of one example, "
                     "a dict of the default's options (flip, pad) or None (random flip + pad-and-crop)")


def _is_keras_layer(obj) -> bool:
    """True for a Keras 3 layer (``keras.layers.Layer``) where ``tf.keras`` is tf-keras."""
    try:
        import keras
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, getattr(getattr(keras, "layers", None), "Layer", ()))
