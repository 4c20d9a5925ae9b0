"""Per-example clipping of a DP step: the clipped sum of one (micro-)batch.

For per-example gradients ``g_i`` restricted to the step's coordinates ``I_s`` (see
:mod:`~sparta_tf.dp_step.keep`), padding mask ``w_i`` in ``{0, 1}`` and clip norm ``C``::

    c_i = w_i min(1, C / ||g_i[I_s]||_2)            S = sum_i c_i g_i[I_s]

so every example moves ``S`` by at most ``C`` in L2 (the sensitivity the Gaussian mechanism
assumes). The math and its guarantees (safety margin, non-finite examples) are
:mod:`sparta_tf.dp_step.clipping`'s; with ``I_s = I`` a book-keeping engine gives ``S`` without
materialising ``g_i`` (:func:`~sparta_tf.per_example.bookkeeping.clipped_batch`).
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from sparta_tf.dp_step.clipping import clipped_sum
from sparta_tf.dp_step.keep import KeepMasks, restrict
from sparta_tf.per_example.bookkeeping import clipped_batch


class BatchStatistic(NamedTuple):
    """What a release's statistic returns for one (micro-)batch: the sums to add up, the
    per-example losses and predictions for the metrics, and the examples that contributed
    (``kept``, ``[B]``: real, with a finite input and norm; :mod:`~sparta_tf.dp_step.usable_examples`)."""

    sums: list
    losses: tf.Tensor
    predictions: object
    kept: tf.Tensor


class ClippedSum:
    """``S = sum_i c_i g_i[I_s]`` of a (micro-)batch (see the module doc)."""

    def __init__(self, clip_norm: float):
        self.clip_norm = clip_norm

    def __call__(self, engine, x, y, loss_fn, valid: tf.Tensor, keep: KeepMasks | None) -> BatchStatistic:
        """``valid``: the real examples (``w_i = 1``); ``keep``: ``1_s`` of the step, None for ``I_s = I``."""
        if keep is None:
            result = clipped_batch(engine, x, y, loss_fn, valid, self.clip_norm)
            return BatchStatistic(result.sums, result.losses, result.predictions, result.kept)
        result = engine(x, y, loss_fn, valid)  # a materialising engine: the filter acts on g_i
        sums, norms = clipped_sum(restrict(result.grads, keep, batch_dims=1), self.clip_norm, result.valid)
        kept = tf.logical_and(result.valid, tf.math.is_finite(norms))  # clipped_sum's keep
        return BatchStatistic(sums, result.losses, result.predictions, kept)
