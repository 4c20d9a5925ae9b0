"""Examples a DP step samples but cannot use: counted per epoch, and reported in the logs.

A sampled example contributes exactly zero to the clipped sum when it cannot be clipped: its
input (or, with augmentation multiplicity, one of its views' inputs) is NaN or infinite
(:func:`~sparta_tf.per_example.engines.finite_rows`), or its gradient's norm is
(:func:`~sparta_tf.dp_step.clipping.clip_factors`). That keeps the guarantee (such an example moves
nothing), but a run whose examples are all dropped still spends its ε and learns nothing. So, per
epoch::

    sampled = #{i in B_t : w_i = 1}                summed over the epoch's steps
    dropped = #{i in B_t : w_i = 1, c_i g_i not used}

``dropped`` is the ``non_finite`` metric (the progress line, ``History`` and the CLI's
``results.json``); an epoch with ``dropped > 0`` logs a warning, and one with ``sampled > 0`` and
``dropped = sampled`` logs an error-level message that says the epoch learnt nothing.

Both counts are statistics of the private data, like the training loss: they are in the logs, not
in anything the privacy guarantee covers (the model is). So they never stop ``fit``: whether a
model comes out must not depend on them. With one finite example added to a data set whose
examples are all non-finite, an epoch samples it with probability ``1 - (1 - q)^T``, so a stop on
``dropped = sampled`` would release far more than (ε, δ) allows about that example. A run stops
only on what the DP steps release, its weights (:class:`~sparta_tf.callbacks.NonFiniteGuard`).
"""

from __future__ import annotations

import logging

import tensorflow as tf

from sparta_tf.backend import KERAS3

logger = logging.getLogger(__name__)

METRIC_NAME = "non_finite"


class NonFiniteExamples(tf.keras.metrics.Metric):
    """The epoch's ``dropped`` (its value) and ``sampled`` counts (see the module doc)."""

    def __init__(self, name: str = METRIC_NAME, **kwargs):
        super().__init__(name=name, **kwargs)
        self.dropped = self.add_weight(name="dropped", initializer="zeros")
        self.sampled = self.add_weight(name="sampled", initializer="zeros")

    def update_state(self, sampled: tf.Tensor, kept: tf.Tensor) -> None:
        """``sampled``, ``kept``: ``[B]`` bool, the real examples of a (micro-)batch and those used."""
        sampled = tf.cast(sampled, tf.bool)
        dropped = tf.logical_and(sampled, tf.logical_not(tf.cast(kept, tf.bool)))
        self.dropped.assign_add(tf.reduce_sum(tf.cast(dropped, self.dropped.dtype)))
        self.sampled.assign_add(tf.reduce_sum(tf.cast(sampled, self.sampled.dtype)))

    def result(self) -> tf.Tensor:
        """``dropped`` over all replicas. Keras 2 syncs a metric's result across replicas itself; Keras 3
        reads each replica's own count in the step and logs the replicas' mean, so the sum is taken here."""
        dropped = tf.convert_to_tensor(self.dropped)
        context = tf.distribute.get_replica_context()
        if KERAS3 and context is not None and context.num_replicas_in_sync > 1:
            return context.all_reduce(tf.distribute.ReduceOp.SUM, dropped)
        return tf.identity(dropped)

    def counts(self) -> tuple[int, int]:
        """``(dropped, sampled)`` so far this epoch."""
        return int(round(float(self.dropped.numpy()))), int(round(float(self.sampled.numpy())))


class DroppedExamplesReport(tf.keras.callbacks.Callback):
    """Logs, after each epoch, how many of its sampled examples were dropped (see the module doc): an
    error-level message when all were, a warning when some were. It never stops ``fit``.

    The counts are read after every step: validation at the end of an epoch resets the model's
    metrics before ``on_epoch_end`` runs."""

    def __init__(self, metric: NonFiniteExamples, units: str = "examples"):
        super().__init__()
        self.metric = metric
        self.units = units  # what a unit of the DP step is, in the messages: "examples" or "users"
        self._counts = (0, 0)

    def on_epoch_begin(self, epoch, logs=None):
        self._counts = (0, 0)

    def on_train_batch_end(self, batch, logs=None):
        self._counts = self.metric.counts()

    def on_epoch_end(self, epoch, logs=None):
        dropped, sampled = self._counts
        if sampled and dropped == sampled:
            logger.error("epoch %d: all %d sampled %s were dropped as non-finite (a NaN or infinite input, augmented "
                         "view or gradient), so the epoch spent its privacy budget and learnt nothing; training goes "
                         "on (stopping on this count of the private data would reveal it): check the data "
                         "(np.isfinite) and the augmentation, or lower the learning rate if the loss diverged",
                         epoch + 1, sampled, self.units)
        elif dropped:
            logger.warning("epoch %d: %d of %d sampled %s were dropped as non-finite (a NaN or infinite input, "
                           "augmented view or gradient) and contributed nothing", epoch + 1, dropped, sampled,
                           self.units)
