"""The sum over micro-batches (and replicas) of a DP step.

A step's batch of ``k P`` rows (Poisson sample padded to a multiple of the physical batch size
``P``, see :mod:`sparta_tf.privacy.sampling`) is processed as ``k`` micro-batches ``B^(j)``::

    S = sum_{j < k} s(B^(j))          s: the release's per-(micro-)batch statistic (additive)

then summed over the replicas of a ``tf.distribute`` strategy (all-reduce), so that the noise is
added once to the global sum. Per-replica ``P`` is the physical batch size over the replicas.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

Statistic = Callable[..., list]  # (x, y, weights, micro-batch index) of one micro-batch -> its sums


class MicroBatches:
    """``S = sum_j s(B^(j))`` over micro-batches of ``size`` rows (None: the batch is one micro-batch)."""

    def __init__(self, size: int | None):
        self.size = size

    @classmethod
    def per_replica(cls, physical_batch_size: int | None, rows_per_unit: int = 1) -> MicroBatches:
        """Micro-batches of ``P / R`` units on each of the ``R`` replicas in sync (``P``: the global
        physical batch size; a ValueError unless ``R`` divides it), ``rows_per_unit`` rows each (the
        ``k`` rows of a user, :mod:`~sparta_tf.dp_step.user_units`; 1: a unit is an example)."""
        if physical_batch_size is None:
            return cls(None)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if physical_batch_size % replicas:
            raise ValueError(
                f"physical_batch_size={physical_batch_size} is not divisible by the "
                f"{replicas} replicas; use a multiple of {replicas}"
            )
        return cls(physical_batch_size // replicas * rows_per_unit)

    def sum(self, statistic: Statistic, x, y, weights: tf.Tensor, specs: Sequence[tf.TensorSpec]) -> list:
        """``statistic(x, y, weights, j)`` summed over the micro-batches ``j``; ``specs``: its outputs' shapes."""
        if self.size is None:
            return statistic(x, y, weights, tf.constant(0))
        micro = self.size
        total = tf.shape(weights)[0]
        tf.debugging.assert_equal(
            total % micro, 0,
            message="batch length is not a multiple of the physical batch size; feed "
            "batches from sparta_tf.privacy.PoissonSampler with the same physical_batch_size",
        )

        def micro_batch(t, i):
            return tf.reshape(t, tf.concat([[-1, micro], tf.shape(t)[1:]], 0))[i]

        def body(i, sums):
            part = tf.nest.map_structure(lambda t: micro_batch(t, i), (x, y, weights))
            new = statistic(*part, i)
            return i + 1, [a + b for a, b in zip(sums, new)]

        zeros = [tf.zeros(s.shape, s.dtype) for s in specs]
        _, sums = tf.while_loop(lambda i, _: i < total // micro, body, (tf.constant(0), zeros))
        return sums


def all_reduce_sum(sums: list) -> list:
    """``sum_r S_r`` over the replicas in sync (``sums`` itself outside a multi-replica step)."""
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        return context.all_reduce(tf.distribute.ReduceOp.SUM, sums)
    return sums
