"""Augmentation multiplicity: each example's gradient is the mean over ``K`` augmented views, clipped once.

De et al. 2022 ("Unlocking high-accuracy differentially private image classification through
scale", Sec. 3.2). For example ``i`` of a (micro-)batch and ``K`` views
``v_ik = A(x_i; xi_ik)`` drawn from the run's ``augmult`` stream (:mod:`sparta_tf.random_streams`,
folded with the step, the micro-batch and the replica)::

    g_i = (1/K) sum_k grad L(v_ik, y_i)          one example's gradient: the mean over its views
    c_i = min(1, C / ||g_i||)                    clipped once, as one example

so each example still moves the clipped sum by at most ``C``: the mechanism, its sensitivity and
the ledger are those of ``K = 1`` (``K`` never enters the accounting), while the noise-free part of
``g_i`` averages over augmentations and the signal-to-noise ratio rises.

Layout. The engines see ``K B`` rows, row ``i K + k`` being view ``k`` of example ``i``
(``tf.repeat``'s order), and treat the ``K`` rows of an example as one example, as they treat the
time steps of ``TimeDistributed``: the loss of row ``(i, k)`` enters the backward pass as
``L(v_ik, y_i) / K``, and the per-row gradients are summed per example
(:mod:`sparta_tf.per_example.engines`). Padding rows and examples with a non-finite input are
zeroed *before* augmentation and marked unusable, so they contribute exactly zero whatever the
augmentation does.

Memory: a micro-batch of ``P`` examples runs ``K P`` rows through the model (``K`` times the
activations of ``K = 1``); the physical batch size still counts examples.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf import random_streams
from sparta_tf.data.view_augmentation import view_augmentation
from sparta_tf.per_example.engines import finite_rows, view_rows

STREAM = "augmult"


def check_multiplicity(augmult) -> int:
    """``augmult`` as an int >= 1, or a ValueError naming the fix."""
    if isinstance(augmult, bool) or not isinstance(augmult, int) or augmult < 1:
        raise ValueError(f"augmult={augmult!r} must be an integer >= 1 (views per example; 1: no augmentation "
                         "multiplicity); use e.g. augmult=4")
    return augmult


class AugmentationMultiplicity:
    """``K`` views per example from ``augmentation`` (see :mod:`sparta_tf.data.view_augmentation`),
    keyed by ``seed`` (a tf.Variable or int: the run's public seed, :attr:`~sparta_tf.DPModel.public_seed`)."""

    def __init__(self, views: int, augmentation, seed):
        self.views = check_multiplicity(views)
        self.augmentation = view_augmentation(augmentation)
        self.seed = seed

    def __repr__(self) -> str:
        return f"AugmentationMultiplicity(views={self.views}, augmentation={self.augmentation!r})"

    def key(self, step, micro_batch) -> tf.Tensor:
        """The Philox key of the views of ``step``'s micro-batch ``micro_batch`` on this replica."""
        key = random_streams.step_key(self.seed, STREAM, step)
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(micro_batch, tf.int64), alg=random_streams.TF_ALGORITHM)
        context = tf.distribute.get_replica_context()
        replica = 0 if context is None else context.replica_id_in_sync_group
        return tf.random.experimental.stateless_fold_in(key, tf.cast(replica, tf.int64), alg=random_streams.TF_ALGORITHM)

    def expand(self, x, y, valid: tf.Tensor, key: tf.Tensor):
        """``(views [K B, ...], labels [K B, ...], usable [B])`` of a (micro-)batch: the ``K`` views of
        every example, its label repeated, and the examples that are real and finite (the others'
        views are views of zeros)."""
        x, usable = finite_rows(x, valid)
        repeated = tf.nest.map_structure(lambda t: view_rows(t, self.views), x)
        views = self.augmentation(repeated, key)
        labels = tf.nest.map_structure(lambda t: view_rows(t, self.views), y)
        return views, labels, usable

    def check(self, x) -> None:
        """Before the first step: a ValueError (one line) when the augmentation cannot take ``x`` (a few
        real examples), changes its shape or dtype, or makes finite inputs non-finite."""
        self.augmentation.check(x)
        key = tf.constant([0, 0], tf.int64)
        rows = tf.nest.map_structure(tf.convert_to_tensor, x)
        try:
            out = self.augmentation(rows, key)
        except Exception as error:  # noqa: BLE001 - reported in one line with the fix
            raise ValueError(f"augmentation {self.augmentation!r} failed on the inputs: "
                             f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}; "
                             "it must map a batch of examples to a batch of the same shape") from None
        for before, after in zip(tf.nest.flatten(rows), tf.nest.flatten(out)):
            if before.shape != after.shape or before.dtype != after.dtype:
                raise ValueError(f"augmentation {self.augmentation!r} changed the inputs from {before.shape} "
                                 f"{before.dtype.name} to {after.shape} {after.dtype.name}; views must keep the "
                                 "example's shape and dtype")
            if _finite(before) and not _finite(after):
                raise ValueError(f"augmentation {self.augmentation!r} returned NaN or infinite views of finite inputs: "
                                 "every such example would be dropped and contribute nothing; fix the augmentation")

    def metric_rows(self, predictions, losses: tf.Tensor, weights: tf.Tensor):
        """``(predictions, losses, weights)`` per view for the metrics: an example's loss (the mean
        over its views) and padding weight repeated over its ``K`` rows."""
        return predictions, view_rows(losses, self.views), view_rows(weights, self.views)

    def describe(self, physical_batch_size: int | None) -> str:
        """One line for dry runs: the views and what a micro-batch runs."""
        rows = ("the whole batch x K rows" if physical_batch_size is None
                else f"{physical_batch_size} examples x {self.views} views = {physical_batch_size * self.views} rows")
        return (f"augmentation multiplicity: {self.views} views per example ({self.augmentation!r}), gradient "
                f"averaged over them then clipped once; each micro-batch runs {rows} ({self.views}x the "
                "activations of one view); the privacy analysis does not change")


def _finite(t: tf.Tensor) -> bool:
    """Whether every value of ``t`` is finite (True for non-floating tensors)."""
    return not t.dtype.is_floating or bool(tf.reduce_all(tf.math.is_finite(t)))
