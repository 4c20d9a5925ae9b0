"""The parts one traced DP step runs with (see :mod:`sparta_tf.dp_step` for the step's math)."""

from __future__ import annotations

from dataclasses import dataclass

from sparta_tf.dp_step.keep import GradientFilter, KeepMasks
from sparta_tf.dp_step.micro_batches import MicroBatches
from sparta_tf.dp_step.release import Release
from sparta_tf.trainable import TrainableSet


@dataclass(frozen=True)
class StepParts:
    """``engine``: computes ``g_i`` or ``S`` (:func:`~sparta_tf.per_example.make_engine`);
    ``gradient_filter``: ``I_s`` per step; ``micro_batches``: the sum over micro-batches;
    ``release``: the statistic and what is released; ``trainable_set``: the coordinates ``I``."""

    engine: object
    gradient_filter: GradientFilter
    micro_batches: MicroBatches
    release: Release
    trainable_set: TrainableSet

    def keep_masks(self, step) -> KeepMasks | None:
        """``1_s`` of step ``step`` (None: ``I_s = I``)."""
        return self.gradient_filter.keep_masks(self.trainable_set, step)
