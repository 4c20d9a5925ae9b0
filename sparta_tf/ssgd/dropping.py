"""DP-SSGD's gradient dropping (Algorithm 3, Sec. 3.2), a gradient filter of the DP step.

At *every* step ``t``, for each trainable tensor (the kept coordinates ``I`` of a pre-pruned
kernel, or a whole bias / norm / head tensor) a set ``I_ns`` of ``floor(pi_gd |I|)`` coordinates
is dropped (at least one is kept) and ``I_s = I \\ I_ns`` is kept:

* ``"random"``: ``I_ns`` uniformly at random (stateless Philox keyed by the
  ``"gradient_dropping"`` stream of :mod:`sparta_tf.random_streams` at step ``t`` and the
  tensor's index ``k``, so every step draws a fresh set);
* ``"magnitude"``: ``I_ns`` = the ``floor(pi_gd |I|)`` coordinates with the smallest
  ``|theta^(t)|``. The weights are already DP, so by post-processing this costs no privacy.

Only ``I_s`` is clipped, noised and updated, Eqs. (3)-(5)::

    grad^C[I_s, b] = grad[I_s, b] / max(1, ||grad[I_s, b]||_2 / C)                          (3)
    theta^(t+1)[I_s]  = theta^(t)[I_s] - eta/(qn) [ sum_b grad^C[I_s, b] + sigma C zeta ]   (4)
    theta^(t+1)[I_ns] = theta^(t)[I_ns]                                                     (5)

:class:`GradientDropping` is this as a gradient filter (:mod:`sparta_tf.dp_step.keep`): the DP
step zeroes per-example gradients outside ``I_s`` before norms and clipping, zeroes the noise
outside ``I_s``, and the masked optimizer moves neither the dropped weights nor their optimizer
state (momentum / Adam moments), so Eq. (5) holds exactly also with momentum. The sensitivity of
the clipped sum is still ``C``: the privacy cost per step is that of DP-SGD ``M_{q, sigma}``.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from sparta_tf import method_spec, random_streams
from sparta_tf.ssgd.pruning import check_rate, n_dropped
from sparta_tf.trainable import TrainableSet, VariableSelection

DROP_STREAM = "gradient_dropping"
DROP_MODES = method_spec.DROP_MODES


class GradientDropping:
    """Gradient dropping at rate ``pi_gd = rate`` (see the module doc).

    ``mode``: ``"random"`` or ``"magnitude"``; ``seed``: of the ``"gradient_dropping"`` stream
    (dropping is data-independent, so this stream need not be secret); ``applies_to``: optional
    predicate on a :class:`~sparta_tf.trainable.VariableSelection`, False for tensors never
    dropped from (default: every tensor, as in the paper, "at every layer").
    """

    def __init__(self, rate: float, mode: str, seed: int,
                 applies_to: Callable[[VariableSelection], bool] | None = None):
        self.rate = check_rate("drop_rate", rate)
        if mode not in DROP_MODES:
            raise ValueError(f"drop_mode={mode!r} is not one of {DROP_MODES}")
        self.mode = mode
        self.seed = random_streams.check_seed(seed)
        self.applies_to = applies_to

    @property
    def needs_per_example_gradients(self) -> bool:
        """Dropping restricts each example's gradient to ``I_s`` before clipping."""
        return self.rate > 0

    def keep_masks(self, trainable_set: TrainableSet, step) -> list[tf.Tensor] | None:
        """``1_s`` of step ``step`` (:meth:`masks_for_step`); None at rate 0 (plain DP-SGD)."""
        return None if self.rate == 0 else self.masks_for_step(trainable_set, step)

    def masks_for_step(self, trainable_set: TrainableSet, step) -> list[tf.Tensor]:
        """``I_s`` of step ``step``: one boolean tensor (compact shape) per selection. Random:
        ``|I| - floor(pi_gd |I|)`` coordinates uniformly at random from Philox keyed by the
        ``"gradient_dropping"`` stream at ``(seed, step, k)``; magnitude: the coordinates with the
        largest ``|theta|`` (current weights)."""
        key = random_streams.step_key(self.seed, DROP_STREAM, tf.cast(step, tf.int64))
        return [self._mask(selection, k, key) for k, selection in enumerate(trainable_set)]

    def _drops(self, selection: VariableSelection) -> bool:
        return self.rate > 0 and (self.applies_to is None or bool(self.applies_to(selection)))

    def _mask(self, selection: VariableSelection, k: int, key: tf.Tensor) -> tf.Tensor:
        n = selection.size
        if not self._drops(selection) or n_dropped(self.rate, n) == 0:
            return tf.ones(selection.compact_shape, tf.bool)
        n_keep = n - n_dropped(self.rate, n)
        if self.mode == "random":
            sub = tf.random.experimental.stateless_fold_in(key, k, alg=random_streams.TF_ALGORITHM)
            score = tf.random.stateless_uniform([n], seed=sub, alg=random_streams.TF_ALGORITHM)
        else:
            score = tf.abs(tf.reshape(selection.compact(tf.convert_to_tensor(selection.variable)), [-1]))
        kept = tf.math.top_k(score, k=n_keep, sorted=False).indices
        hit = tf.scatter_nd(kept[:, None], tf.ones([n_keep], tf.int32), [n])
        return tf.reshape(hit > 0, selection.compact_shape)
