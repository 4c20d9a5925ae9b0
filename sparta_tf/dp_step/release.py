"""What a DP step releases: the noisy gradient to the optimizer, or SPARTA's noisy mask scores.

A release owns the step's statistic (what each example contributes, additive over
micro-batches) and what is done with its sum ``S_t``:

* :class:`GradientRelease` (DP-SGD)::

      s(B) = sum_i c_i g_i[I_s]                            (:class:`~sparta_tf.dp_step.clip.ClippedSum`)
      g~_t = 1_s (.) (S_t + N(0, sigma^2 C^2 I)) / (q n)    (noise, normalisation, the filter;
                                                           BandMF: correlated noise, :mod:`~sparta_tf.dp_step.correlated_noise`)
      theta <- optimizer(theta, g~_t)                      (coordinates in I_s only)
      A[I] <- A[I] + (1 - b_t)(theta[I] - A[I])           (with a weight average: :mod:`sparta_tf.optim.weight_average`)

* :class:`ScoreRelease` (a selection epoch, :mod:`sparta_tf.selection.scoring`): ``s(B)`` is the
  scorer's statistic (e.g. ``sum_i c_i |g_i|``), and the scorer adds ``N(0, sigma^2 C^2 I)`` and
  accumulates the scores; no weight moves.

Both are one Poisson-subsampled Gaussian mechanism with the run's ``(q, sigma)`` per step.
"""

from __future__ import annotations

from typing import Protocol

import tensorflow as tf

from sparta_tf.dp_step.clip import BatchStatistic, ClippedSum
from sparta_tf.dp_step.correlated_noise import CorrelatedNoise
from sparta_tf.dp_step.keep import KeepMasks, restrict
from sparta_tf.dp_step.noise import GaussianNoise
from sparta_tf.dp_step.normalise import ExpectedBatchNormalisation
from sparta_tf.optim.masked_optimizer import MaskedOptimizer
from sparta_tf.optim.weight_average import WeightAverage
from sparta_tf.per_example.bookkeeping import BookkeepingEngine
from sparta_tf.precision import accumulation_dtype
from sparta_tf.trainable import TrainableSet


class Release(Protocol):
    """What a step asks of its release (see the module doc)."""

    uses_gradient_filter: bool
    """Whether the step's gradient filter applies (False: ``I_s = I`` while this release runs)."""

    def selections(self, trainable_set: TrainableSet) -> list:
        """The selections whose per-example gradients the statistic needs."""

    def needs_per_example_gradients(self) -> bool:
        """True when the statistic needs ``g_i`` themselves (a materialising engine)."""

    def statistic_specs(self, trainable_set: TrainableSet) -> list[tf.TensorSpec]:
        """Shapes and dtypes of the statistic's sums."""

    def statistic(self, engine, x, y, loss_fn, valid: tf.Tensor, keep: KeepMasks | None) -> BatchStatistic:
        """``s(B)`` of one (micro-)batch."""

    def release(self, sums: list, step: tf.Tensor, keep: KeepMasks | None) -> None:
        """Releases the summed statistic ``S_t`` of step ``step``."""


class GradientRelease:
    """DP-SGD: ``theta <- optimizer(theta, 1_s (.) (S_t + noise) / (q n))``, then ``average`` (a
    :class:`~sparta_tf.optim.weight_average.WeightAverage`, or None) follows ``theta`` on the trainable
    set (see the module doc)."""

    uses_gradient_filter = True

    def __init__(self, clip: ClippedSum, noise: GaussianNoise | CorrelatedNoise, normalise: ExpectedBatchNormalisation,
                 optimizer: MaskedOptimizer, average: WeightAverage | None = None, canaries=None):
        self.clip = clip
        self.noise = noise
        self.normalise = normalise
        self.optimizer = optimizer
        self.average = average
        self.canaries = canaries  # white-box audit canaries (sparta_tf.audit.gradient_canaries), or None

    @classmethod
    def of_mechanism(cls, mechanism, seed: tf.Variable | tf.Tensor, optimizer: MaskedOptimizer,
                     average: WeightAverage | None = None,
                     correlated: CorrelatedNoise | None = None, canaries=None) -> "GradientRelease":
        """DP-SGD's release of ``mechanism`` (a :class:`~sparta_tf.privacy.mechanism.DpSgdMechanism`:
        ``C``, ``sigma``, ``q n``), its noise drawn from ``seed`` (independent, or ``correlated``'s when
        the mechanism has bands: the model's state of BandMF's noise), applied by ``optimizer``, averaged
        by ``average`` (None: no weight average); ``canaries``: a white-box audit's gradient canaries,
        inserted into the clipped sum before the noise and observed after it (None: none)."""
        if (mechanism.bands > 1) != (correlated is not None):
            raise ValueError(f"a mechanism with bands={mechanism.bands} needs "
                             f"{'its CorrelatedNoise' if mechanism.bands > 1 else 'no CorrelatedNoise'}")
        noise = correlated if correlated is not None else GaussianNoise(mechanism, seed)
        return cls(ClippedSum(mechanism.clip_norm), noise, ExpectedBatchNormalisation(mechanism), optimizer, average,
                   canaries)

    def selections(self, trainable_set: TrainableSet) -> list:
        return trainable_set.selections

    def needs_per_example_gradients(self) -> bool:
        return False

    def statistic_specs(self, trainable_set: TrainableSet) -> list[tf.TensorSpec]:
        return [tf.TensorSpec(s.compact_shape, accumulation_dtype(s.variable.dtype)) for s in trainable_set]

    def statistic(self, engine, x, y, loss_fn, valid, keep):
        return self.clip(engine, x, y, loss_fn, valid, keep)

    def noisy_gradient(self, sums: list, step: tf.Tensor, keep: KeepMasks | None) -> list:
        """``g~_t = 1_s (.) (S_t + N(0, sigma^2 C^2 I)) / (q n)``, the same on every replica (with audit
        canaries: inserted into ``S_t``, observed in ``S_t + noise``)."""
        if self.canaries is None:
            noisy = self.normalise(self.noise(sums, step))
        else:
            selections = self.optimizer.selections
            noisy = self.noise(self.canaries.insert(sums, step, selections), step)
            with tf.control_dependencies(self.canaries.observe(noisy, step, selections)):
                noisy = self.normalise([tf.identity(t) for t in noisy])
        return noisy if keep is None else restrict(noisy, keep)

    def release(self, sums, step, keep):
        self.optimizer.apply(self.noisy_gradient(sums, step, keep), keep=keep)
        if self.average is not None:
            self.average.update(self.optimizer.selections)


class ScoreRelease:
    """A selection epoch's step: the scorer's noisy statistic is accumulated; no weight moves.

    ``scorer``: a :class:`~sparta_tf.selection.scoring.SelectionScorer` (its math: that module);
    ``seed``: the run's noise seed."""

    uses_gradient_filter = False

    def __init__(self, scorer, seed: tf.Variable | tf.Tensor):
        self.scorer = scorer
        self.seed = seed

    def selections(self, trainable_set: TrainableSet) -> list:
        return self.scorer.selections

    def needs_per_example_gradients(self) -> bool:
        return not self.scorer.bookkeeping_statistic

    def statistic_specs(self, trainable_set: TrainableSet) -> list[tf.TensorSpec]:
        return [tf.TensorSpec(shape, tf.float32) for shape in self.scorer.statistic_shapes()]

    def statistic(self, engine, x, y, loss_fn, valid, keep):
        if isinstance(engine, BookkeepingEngine):
            return BatchStatistic(*self.scorer.batch_statistic_bookkeeping(engine, x, y, loss_fn, valid))
        result = engine(x, y, loss_fn, valid)
        sums, kept = self.scorer.batch_statistic_and_kept(result.grads, result.valid)
        return BatchStatistic(sums, result.losses, result.predictions, kept)

    def release(self, sums, step, keep):
        self.scorer.release(sums, self.seed, step)
