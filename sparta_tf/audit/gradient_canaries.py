"""White-box gradient ("Dirac") canaries inside the DP step (Steinke, Nasr and Jagielski, NeurIPS 2023).

``m`` canaries on ``m`` distinct coordinates ``c_1 .. c_m`` of one trainable variable (by default
the model's head kernel). Canary ``j`` is put into the run with probability 1/2 (``S_j``). The
coordinates and the coin flips come from the ``gradient_canaries`` stream
(:mod:`sparta_tf.random_streams`), not the data canaries' ``canaries`` stream: in a run with both
(``sparta-audit --white-box --data-canaries``) each data canary's coin flip must be independent of
everything else in the run, the gradient canaries' coin flips included. An included canary is a
participant of the DP step like any example (or user):

* **sampled** by the run's own sampler: the :class:`~sparta_tf.privacy.sampling.PoissonSampler`
  draws ``n + m_in`` participants (``m_in`` included canaries without rows,
  :meth:`~sparta_tf.privacy.sampling.PoissonSampler.extra_mask`), at the sampler's rate and in its
  cyclic groups with correlated noise; at user level the
  :class:`~sparta_tf.privacy.user_sampling.UserPoissonSampler` draws them as ``m_in`` extra users (a
  canary user's examples all carry its one gradient, whose mean is that gradient);
* **clipped** by calling the step's clipping function
  (:func:`~sparta_tf.dp_step.clipping.clipped_sum`) on the canaries' gradients directly: a canary's
  gradient is ``a C e_{c_j}`` (``a = 2``), clipped to ``C e_{c_j}``. Its norm is that of the tensor
  built here, not one an engine computed from layer inputs and output gradients, so an engine's
  per-example norm bug cannot show up in this audit (the black-box audit's data canaries go through
  the engine);
* **summed** into the step's clipped sum after the all-reduce and **before** the step's noise
  (independent or correlated), so it meets exactly the mechanism the ledger charges.

The canary coordinates are reserved: the data's clipped sum is set to zero there (a projection of
every example's contribution, which can only shrink its norm), so the released noisy sum on
``c_j`` is ``x_t,j = C [j sampled at t] + noise_t,j``. The auditor (white box) reads ``x_t,j`` at
every step that releases a gradient (:class:`CanaryObservations`) and scores each canary
(:mod:`sparta_tf.audit.white_box`). Steps whose trainable set does not hold the canary variable
whole or as entries (SPARTA's selection epoch releases scores, not gradients; a phase that freezes it
or trains rows of it) neither insert nor observe canaries, and a step that trains some entries of it
(DP-FROST's mask, DP-SSGD's pre-pruning) only those canaries' (the others are NaN in its
observations): a canary then takes part in fewer mechanisms than an example, which keeps the lower
bound valid.

The guarantee audited is the ledger's, for neighbouring data sets that differ in one participant
(a canary), with ``n + m_in`` participants in all.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from sparta_tf import keras_trainer, random_streams
from sparta_tf.backend import variable_key
from sparta_tf.dp_step.clipping import clipped_sum

STREAM = "gradient_canaries"
GRADIENT_SCALE = 2.0
"""A canary's gradient before clipping, in units of ``C``: above 1, so the clip is exercised."""


def head_kernel(model: tf.keras.Model) -> tf.Variable:
    """The last trainable variable of rank 2 (a classifier head's kernel), the default canary variable."""
    kernels = [v for v in model.trainable_variables if len(v.shape) == 2]
    if not kernels:
        raise ValueError("white-box canaries need a trainable kernel (rank 2) to live on; pass variable=")
    return kernels[-1]


class GradientCanaries:
    """``count`` Dirac canaries on ``variable`` (module doc), drawn from ``seed``'s ``gradient_canaries`` stream.

    Attributes:
      included: bool ``[m]``, each canary's coin flip ``S_j``.
      coordinates: int ``[m]``, the flat indices ``c_j`` in ``variable``.
      participants: ``m_in``, the included canaries (extra participants of the sampler).
    """

    def __init__(self, variable: tf.Variable, count: int, seed: int, clip_norm: float):
        size = int(np.prod(variable.shape))
        if isinstance(count, bool) or not isinstance(count, int) or not 2 <= count <= size:
            raise ValueError(f"count={count!r} canaries: need an integer in [2, {size}] (one coordinate of "
                             f"{variable.name} each)")
        rng = random_streams.numpy_rng(seed, STREAM)
        self.variable = variable
        self.coordinates = np.sort(rng.choice(size, count, replace=False)).astype(np.int64)
        self.included = rng.random(count) < 0.5
        self.participants = int(self.included.sum())
        self.clip_norm = float(clip_norm)
        self.sampler = None  # the run's PoissonSampler, bound by fit
        self.observed = tf.Variable(tf.zeros([count], tf.float32), trainable=False, name="canary_observations")
        self.observed_at = tf.Variable(-1, dtype=tf.int64, trainable=False, name="canary_observed_at")

    @property
    def count(self) -> int:
        return len(self.coordinates)

    def bind_sampler(self, sampler) -> None:
        """Makes the included canaries ``sampler``'s extra participants (``sampler.extra == m_in``)."""
        if sampler.extra != self.participants:
            raise ValueError(f"the sampler has {sampler.extra} extra participants for {self.participants} "
                             "included canaries")
        self.sampler = sampler

    def _slot(self, selections):
        """``(k, available, positions)`` for the canary variable's selection ``k`` in ``selections`` (the
        step's, in the order of its sums): which canaries' coordinates it trains (bool ``[m]``) and their
        flat positions in its compact tensor; None when it trains none (absent, or rows of it)."""
        for k, selection in enumerate(selections):
            if variable_key(selection.variable) != variable_key(self.variable):
                continue
            if selection.kind == "dense":
                return k, np.ones(self.count, bool), self.coordinates
            if selection.kind == "entries":
                entries = np.asarray(selection.entries, np.int64)
                order = np.argsort(entries, kind="stable")
                found = np.searchsorted(entries[order], self.coordinates)
                found = np.minimum(found, len(entries) - 1)
                available = entries[order][found] == self.coordinates
                return (k, available, order[found][available]) if available.any() else None
            return None
        return None

    def _sampled(self, step) -> tf.Tensor:
        """Bool ``[m]``: the canaries in step ``step``'s sample (excluded ones never are)."""
        if self.sampler is None:
            raise ValueError("the canaries' sampler is not bound: fit binds it (train with fit(x, y))")
        extra = self.sampler.extra_mask(step)
        position = np.cumsum(self.included) - 1  # canary j's extra-participant position, if included
        gathered = tf.gather(extra, np.where(self.included, position, 0))
        return tf.logical_and(gathered, tf.constant(self.included))

    def insert(self, sums: list, step, selections) -> list:
        """``sums`` with the data's sum zeroed on the canary coordinates the step trains and the sampled
        canaries' clipped gradients added there (before the step's noise)."""
        slot = self._slot(selections)
        if slot is None:
            return sums
        k, available, positions = slot
        dtype = sums[k].dtype
        gradients = tf.eye(self.count, dtype=dtype) * tf.cast(GRADIENT_SCALE * self.clip_norm, dtype)
        (canary_sum,), _ = clipped_sum([gradients], self.clip_norm, self._sampled(step))
        flat = tf.reshape(sums[k], [-1])
        flat = tf.tensor_scatter_nd_update(flat, tf.constant(positions[:, None]),
                                           tf.gather(tf.cast(canary_sum, dtype), np.flatnonzero(available)))
        out = list(sums)
        out[k] = tf.reshape(flat, tf.shape(sums[k]))
        return out

    def observe(self, noisy_sums: list, step, selections) -> list:
        """Records ``x_t`` (the noisy sums on the canary coordinates; NaN where the step does not train
        them) of step ``step``; returns the ops."""
        slot = self._slot(selections)
        if slot is None:
            return []
        k, available, positions = slot
        values = tf.gather(tf.cast(tf.reshape(noisy_sums[k], [-1]), tf.float32), positions)
        observed = tf.tensor_scatter_nd_update(tf.fill([self.count], float("nan")),
                                               tf.constant(np.flatnonzero(available)[:, None]), values)
        return [self.observed.assign(observed), self.observed_at.assign(tf.cast(step, tf.int64))]


class CanaryObservations(tf.keras.callbacks.Callback):
    """Collects ``x_t`` of every step that observed the canaries (a ``[T, m]`` array, :attr:`rows`)."""

    def __init__(self, canaries: GradientCanaries):
        super().__init__()
        self.canaries = canaries
        self.rows: list[np.ndarray] = []
        self.steps: list[int] = []

    def on_train_begin(self, logs=None):
        steps = keras_trainer.steps_per_execution(self.model)
        if steps > 1:  # Keras calls back once per call: the canaries of all but its last step would be lost
            raise ValueError(f"the white-box audit reads the canaries after every step, but the model runs {steps} "
                             "steps a call; compile it with steps_per_execution=1 (the default)")

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.dp_step.numpy()) - 1
        if int(self.canaries.observed_at.numpy()) == step:
            self.rows.append(self.canaries.observed.numpy().copy())
            self.steps.append(step)

    @property
    def array(self) -> np.ndarray:
        return np.stack(self.rows) if self.rows else np.zeros([0, self.canaries.count], np.float32)
