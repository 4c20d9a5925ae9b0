"""Private mask scores, accumulated inside the DP step during a selection epoch.

For every Poisson batch ``B_t`` of the selection epoch, with per-example
gradients ``g_i`` over the maskable kernels, clip factors
``c_i = min(1, C / ||g_i||_2)`` (the norm over all maskable kernels) and
rows ``G_j``, the released per-step statistic is one of

* ``sum_abs`` (SPARTA, the paper's Algorithm 1)::

      u~_t = sum_i c_i |g_i| + N(0, sigma^2 C^2 I);   v~_t[j] = sum_{k in G_j} u~_t[k]

* ``abs_sum`` (the authors' public code)::

      u~_t = |sum_i c_i g_i| + N(0, sigma^2 C^2 I);   v~_t[j] = sum_{k in G_j} u~_t[k]

* ``signed`` (the paper's Algorithm 2, "DP-SGD gradients", entry-wise)::

      u~_t = sum_i c_i g_i + N(0, sigma^2 C^2 I);     final score |mean_t u~_t|

* ``oracle`` (Algorithm 3, NOT private): ``u_t = sum_i |g_i|``, no clipping, no noise.

All private variants have L2 sensitivity ``C`` (``|| |a| - |b| || <= ||a - b||``),
so each step is one Poisson-subsampled Gaussian mechanism with the run's
``(q, sigma)`` (the paper's Prop. 4.1). Scores are averaged over the epoch.

With row granularity only ``v~_t`` is released, and the sum of ``|G_j|``
independent ``N(0, sigma^2 C^2)`` coordinates is exactly ``N(0, |G_j| sigma^2
C^2)``, so the noise is drawn per row with that variance: the same output
distribution at a fraction of the cost. The raw per-example quantities never
leave the step: only noisy sums reach the accumulators.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from sparta_tf.dp_step.clipping import clip_factors, per_example_squared_norms
from sparta_tf.dp_step.noise import gaussian_noise
from sparta_tf.groups import RowGroup
from sparta_tf.method_spec import GRANULARITIES, SCORES
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.trainable import VariableSelection

SELECTION_NOISE_STREAM = "selection_noise"  # sparta_tf.random_streams: the released scores' noise


def check_score(score: str, granularity: str) -> None:
    if score not in SCORES:
        raise ValueError(f"score={score!r} is not one of {SCORES}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not one of {GRANULARITIES}")
    if score == "signed" and granularity != "entry":
        raise ValueError("score='signed' (DP-SGD gradients) is entry-wise: use granularity='entry'")


class SelectionScorer(tf.Module):
    """Accumulates the per-row (or per-entry) scores of one selection epoch; ``C`` and ``sigma`` are
    ``mechanism``'s (the DP model's :class:`~sparta_tf.privacy.mechanism.DpSgdMechanism`: a selection
    step is the same Gaussian mechanism as a training step)."""

    def __init__(
        self,
        groups: Sequence[RowGroup],
        mechanism: DpSgdMechanism,
        *,
        score: str = "sum_abs",
        granularity: str = "row",
    ):
        super().__init__(name="selection_scorer")
        check_score(score, granularity)
        if not groups:
            raise ValueError("no maskable kernels to score (the model has no Dense/Conv/EinsumDense kernels besides the head)")
        self.groups = list(groups)
        self.score = score
        self.granularity = granularity
        self.mechanism = mechanism
        self.private = score != "oracle"
        self.selections = [VariableSelection(g.variable) for g in self.groups]
        self.totals = [
            tf.Variable(tf.zeros(self._score_shape(g)), trainable=False, name=f"score_{k}",
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            for k, g in enumerate(self.groups)
        ]
        self.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="score_steps",
                                 aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def _score_shape(self, group: RowGroup) -> tuple[int, ...]:
        return (group.n_rows,) if self.granularity == "row" else group.shape

    # --------------------------------------------------------- inside the step

    def statistic_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of :meth:`batch_statistic`'s outputs."""
        row_sums = self.score in ("sum_abs", "oracle") and self.granularity == "row"
        return [(g.n_rows,) if row_sums else g.shape for g in self.groups]

    def batch_statistic(self, grads: Sequence[tf.Tensor], valid: tf.Tensor) -> list[tf.Tensor]:
        """Noise-free per-(micro-)batch sums; additive over micro-batches."""
        return self.batch_statistic_and_kept(grads, valid)[0]

    def batch_statistic_and_kept(self, grads: Sequence[tf.Tensor], valid: tf.Tensor) -> tuple[list, tf.Tensor]:
        """``(sums, kept)``: :meth:`batch_statistic` and the examples that contributed to it ``[B]``."""
        if self.score == "oracle":
            keep = tf.logical_and(valid, tf.math.is_finite(per_example_squared_norms(grads)))
            factors = tf.cast(keep, grads[0].dtype)
        else:
            factors, keep = clip_factors(per_example_squared_norms(grads), self.mechanism.clip_norm, valid)
        stats = []
        for group, g in zip(self.groups, grads):
            mask = tf.reshape(keep, [-1] + [1] * (g.shape.rank - 1))
            g = tf.where(mask, g, tf.zeros_like(g))
            if self.score in ("sum_abs", "oracle"):
                g = tf.abs(g)
            if self.score in ("sum_abs", "oracle") and self.granularity == "row":
                per_row = tf.reduce_sum(group.to_row_view(g, batch_dims=1), axis=1)  # [B, rows]
                stats.append(tf.tensordot(factors, per_row, axes=1))
            else:
                stats.append(tf.tensordot(factors, g, axes=1))
        return stats, keep

    @property
    def bookkeeping_statistic(self) -> bool:
        """Whether :meth:`batch_statistic_bookkeeping` computes this score (all but entry-wise
        ``sum_abs`` / ``oracle``, which need every example's ``|g|`` per entry)."""
        return not (self.score in ("sum_abs", "oracle") and self.granularity == "entry")

    def batch_statistic_bookkeeping(self, engine, x, y, loss_fn, valid: tf.Tensor):
        """:meth:`batch_statistic` from a book-keeping engine built for :attr:`selections`:
        ``(stats, losses, predictions, kept)``, without a model's worth of per-example gradients."""
        absolute = self.score in ("sum_abs", "oracle")
        clip_norm = None if self.score == "oracle" else self.mechanism.clip_norm
        result = engine.selection_statistic(x, y, loss_fn, valid, clip_norm, self.groups if absolute else None)
        return result.sums, result.losses, result.predictions, result.kept

    def release(self, stats: Sequence[tf.Tensor], seed: tf.Tensor, step: tf.Tensor) -> None:
        """Adds the step's noise to the batch statistics and accumulates them."""
        if self.score == "abs_sum":
            stats = [self._row_sums(g, tf.abs(s)) for g, s in zip(self.groups, stats)]
        if self.private:
            noise = gaussian_noise([t.shape for t in self.totals], 1.0, seed, step, stream=SELECTION_NOISE_STREAM)
            stats = [s + z * self._noise_std(g) for g, s, z in zip(self.groups, stats, noise)]
        for total, s in zip(self.totals, stats):
            total.assign_add(s)
        self.steps.assign_add(1)

    def _row_sums(self, group: RowGroup, values: tf.Tensor) -> tf.Tensor:
        if self.granularity == "entry":
            return values
        return tf.reduce_sum(group.to_row_view(values), axis=0)

    def _noise_std(self, group: RowGroup) -> float:
        per_coordinate = self.mechanism.noise_std
        return per_coordinate * (np.sqrt(group.row_size) if self.granularity == "row" else 1.0)

    # ------------------------------------------------------------ after epoch

    def scores(self) -> list[np.ndarray]:
        """Epoch-averaged scores per group (``[n_rows]`` or the kernel's shape)."""
        steps = max(1, int(self.steps.numpy()))
        averaged = [t.numpy() / steps for t in self.totals]
        if self.score == "signed":
            averaged = [np.abs(a) for a in averaged]
        return averaged

    def reset(self) -> None:
        for t in self.totals:
            t.assign(tf.zeros_like(t))
        self.steps.assign(0)
