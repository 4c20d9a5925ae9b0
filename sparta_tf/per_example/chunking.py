"""Per-example computations over chunks of the batch, so their temporaries stay small.

A rule that needs each example's own kernel gradient (a convolution's direct norm) makes
temporaries of ``B x positions x fan_in`` floats (patches, shifted views): for the first stage of
ResNet-20-GN at ``B = 128`` about 75 MB, for a 3x3 convolution with 64 channels on 112x112 maps
at ``B = 32`` about 925 MB. :func:`map_over_examples` computes such a per-example quantity a chunk of examples at a
time in a ``tf.map_fn`` (one chunk in flight), so the temporaries are those of one chunk.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

CHUNK_BYTES = 128 * 2**20
"""Temporary bytes one chunk may hold (the chunk size follows from the bytes per example). Below it a
layer's norms run on the whole batch (the per-layer norms run one layer at a time, so only one
layer's temporaries are alive): chunking costs a ``tf.map_fn``, measured slower on ResNet-20-GN."""


def chunk_size(bytes_per_example: int | None, batch: int | None) -> int | None:
    """Examples per chunk, or None when the whole batch fits in :data:`CHUNK_BYTES`, or when the
    batch or the bytes per example are unknown when the step is traced (no chunking: a DP step's
    physical batch is static).

    The batch is split into the fewest chunks that fit, of equal size: ``n = ceil(B / most)``
    chunks of ``ceil(B / n)`` examples, so that padding to whole chunks adds fewer than ``n``
    examples. (Chunks of ``most`` examples each padded a batch just over one chunk to nearly two:
    ResNet-20-GN's first stage with 2 views, 256 rows in chunks of 227, computed 454 rows, and its
    norms took twice as long as on the whole batch.)"""
    if bytes_per_example is None or bytes_per_example <= 0 or batch is None:
        return None
    if batch * bytes_per_example <= CHUNK_BYTES:
        return None
    most = max(1, CHUNK_BYTES // bytes_per_example)
    chunks = -(-batch // most)
    return -(-batch // chunks)


def map_over_examples(fn: Callable[..., tf.Tensor], tensors: Sequence[tf.Tensor], chunk: int,
                      output_shape: Sequence[int], dtype: tf.DType) -> tf.Tensor:
    """``fn(*tensors)`` (``[B, *output_shape] <- [B, ...]``) computed ``chunk`` examples at a time: the
    batch is padded with zeros to a multiple of ``chunk`` and the padded rows' results are dropped."""
    batch = tf.shape(tensors[0])[0]
    padding = (-batch) % chunk

    def chunked(t):
        t = tf.pad(t, [[0, padding]] + [[0, 0]] * (t.shape.rank - 1))
        return tf.reshape(t, tf.concat([[-1, chunk], tf.shape(t)[1:]], 0))

    results = tf.map_fn(lambda parts: fn(*parts), tuple(chunked(t) for t in tensors),
                        fn_output_signature=tf.TensorSpec([chunk, *output_shape], dtype), parallel_iterations=1)
    return tf.reshape(results, [-1, *output_shape])[:batch]
