"""Shuffled fixed-size batches: the explicit NON-Poisson input pipeline (not covered by the accountant).

The accountant analyses Poisson sampling (:mod:`sparta_tf.privacy.sampling`);
``sampling="shuffle"`` trades that guarantee for fixed batch sizes, and a run
using it reports itself as not covered. Each epoch is one permutation drawn
from the ``"shuffle"`` stream of the run seed (:mod:`sparta_tf.random_streams`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from sparta_tf import random_streams
from sparta_tf.privacy.array_inputs import check_positive_int, check_start_step, gather_rows, num_examples, to_host_tensors

__all__ = ["SHUFFLE_DOMAIN", "shuffled_dataset", "shuffled_steps_per_epoch"]

SHUFFLE_STREAM = "shuffle"
#: Domain constant of the shuffled-batches stream.
SHUFFLE_DOMAIN: int = random_streams.domain(SHUFFLE_STREAM)


def shuffled_steps_per_epoch(n: int, batch_size: int, drop_remainder: bool = False) -> int:
    """Steps per epoch of :func:`shuffled_dataset`: ``ceil(n / B)`` (``floor`` if dropping)."""
    n = check_positive_int(n, "n", "pass the number of training examples")
    b = check_positive_int(batch_size, "batch_size", "pass a positive batch size")
    if drop_remainder:
        if b > n:
            raise ValueError(
                f"batch_size={b} > n={n} with drop_remainder=True leaves no batch; "
                "lower batch_size or set drop_remainder=False."
            )
        return n // b
    return -(-n // b)


def shuffled_dataset(
    x: Any,
    y: Any,
    batch_size: int,
    seed: int | None = None,
    drop_remainder: bool = False,
    start_step: int = 0,
) -> tf.data.Dataset:
    """Fixed-size shuffled batches: the explicit NON-Poisson option.

    **Privacy warning:** the accountant's guarantee assumes Poisson sampling
    (each example joins each step independently with probability ``q``). It
    does NOT cover this option; runs that use it must be reported as not
    covered by the accountant (shuffling without replacement has no matching
    amplification analysis here and can give a weaker guarantee).

    Each epoch draws a fresh permutation of the ``n`` examples
    (``stateless_shuffle`` keyed by the ``"shuffle"`` stream at ``epoch``) and
    cuts it into ``shuffled_steps_per_epoch(n, B, drop_remainder)`` batches,
    so every example is used exactly once per epoch. Elements are
    ``(x_batch, y_batch, sample_weight)`` with static leading dimension ``B``:
    weights are 1.0, and the last partial batch is padded to ``B`` with
    weight-0.0 copies of example 0 (with ``drop_remainder=True`` the
    ``n mod B`` examples left over are skipped this epoch instead). The
    dataset repeats forever; element ``j`` is global step
    ``start_step + j``, so resuming reproduces the uninterrupted run.
    """
    n = num_examples(x, y)
    b = check_positive_int(batch_size, "batch_size", "pass a positive batch size")
    steps = shuffled_steps_per_epoch(n, b, drop_remainder)
    seed = random_streams.resolve_seed(seed)
    start_step = check_start_step(start_step)
    x_t, y_t = to_host_tensors(x), to_host_tensors(y)
    padded_len = steps * b

    def epoch_batches(epoch: tf.Tensor) -> tf.data.Dataset:
        perm = tf.random.experimental.stateless_shuffle(
            tf.range(n, dtype=tf.int64),
            seed=random_streams.step_key(seed, SHUFFLE_STREAM, epoch),
            alg=random_streams.TF_ALGORITHM,
        )
        if drop_remainder:
            indices, weights = perm[:padded_len], tf.ones([padded_len], tf.float32)
        else:
            indices = tf.pad(perm, [[0, padded_len - n]])
            weights = tf.sequence_mask(n, padded_len, dtype=tf.float32)
        return tf.data.Dataset.from_tensor_slices(
            (tf.reshape(indices, [steps, b]), tf.reshape(weights, [steps, b]))
        )

    def element(indices: tf.Tensor, weights: tf.Tensor) -> tuple[Any, Any, tf.Tensor]:
        return gather_rows(x_t, indices), gather_rows(y_t, indices), weights

    ds = tf.data.Dataset.counter(start_step // steps, dtype=tf.int64)
    ds = ds.flat_map(epoch_batches).skip(start_step % steps)
    return ds.map(element).prefetch(tf.data.AUTOTUNE)
