"""The parts one traced DP step runs with (see :mod:`sparta_tf.dp_step` for the step's math)."""

from __future__ import annotations

from dataclasses import dataclass

from sparta_tf.dp_step.keep import GradientFilter, KeepMasks
from sparta_tf.dp_step.micro_batches import MicroBatches, all_reduce_sum
from sparta_tf.dp_step.release import Release
from sparta_tf.dp_step.user_units import UserUnits
from sparta_tf.dp_step.views import AugmentationMultiplicity
from sparta_tf.trainable import TrainableSet


@dataclass(frozen=True)
class StepParts:
    """``engine``: computes ``g_i`` or ``S`` (:func:`~sparta_tf.per_example.make_engine`);
    ``gradient_filter``: ``I_s`` per step; ``micro_batches``: the sum over micro-batches;
    ``release``: the statistic and what is released; ``trainable_set``: the coordinates ``I``;
    ``views``: augmentation multiplicity (:mod:`~sparta_tf.dp_step.views`; None: each example as is);
    ``users``: the user units of user-level DP (:mod:`~sparta_tf.dp_step.user_units`; None: each
    example is a unit)."""

    engine: object
    gradient_filter: GradientFilter
    micro_batches: MicroBatches
    release: Release
    trainable_set: TrainableSet
    views: AugmentationMultiplicity | None = None
    users: UserUnits | None = None

    def keep_masks(self, step) -> KeepMasks | None:
        """``1_s`` of step ``step`` (None: ``I_s = I``)."""
        return self.gradient_filter.keep_masks(self.trainable_set, step)

    def run(self, x, y, weights, loss_fn, step, on_batch, on_examples=None) -> None:
        """One DP step ``t = step``: ``S_t`` summed over micro-batches and replicas, then released.
        ``on_batch(y, predictions, losses, weights)``: per (micro-)batch, for the metrics;
        ``on_examples(sampled, kept)``: per (micro-)batch, the real examples ``[B]`` and those that
        contributed (:mod:`~sparta_tf.dp_step.usable_examples`)."""
        keep = self.keep_masks(step)

        def statistic(x, y, weights, micro_batch):
            if self.users is not None:
                return user_statistic(x, y, weights, micro_batch)
            valid = weights > 0
            sampled = valid
            if self.views is not None:
                x, y, valid = self.views.expand(x, y, valid, self.views.key(step, micro_batch))
            result = self.release.statistic(self.engine, x, y, loss_fn, valid, keep)
            if on_examples is not None:
                on_examples(sampled, result.kept)
            if self.views is None:
                on_batch(y, result.predictions, result.losses, weights)
            else:
                on_batch(y, *self.views.metric_rows(result.predictions, result.losses, weights))
            return result.sums

        def user_statistic(x, y, weights, micro_batch):
            key = None if self.views is None else self.views.key(step, micro_batch)
            rows, labels, valid, sampled = self.users.group(x, y, weights, self.views, key)
            result = self.release.statistic(self.engine, rows, labels, self.users.unit_loss(loss_fn), valid, keep)
            if on_examples is not None:
                on_examples(sampled, result.kept)
            views = 1 if self.views is None else self.views.views
            on_batch(*self.users.metric_rows(labels, result.predictions, result.losses, weights, views))
            return result.sums

        sums = self.micro_batches.sum(statistic, x, y, weights, self.release.statistic_specs(self.trainable_set))
        self.release.release(all_reduce_sum(sums), step, keep)
