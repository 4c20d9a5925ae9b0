"""BandMF's correlated noise in the DP step: ``S_t -> S_t + w_t``, ``w = C^{-1} z``.

For a lower-triangular ``b``-banded Toeplitz ``C`` with coefficients ``c_0, ..., c_{b-1}``
(:class:`~sparta_tf.privacy.banded.BandedFactorization`, unit column norm) and the independent draws
``z_t ~ N(0, sigma^2 C_clip^2 I)`` of the ``"dp_sgd_noise"`` stream (:mod:`sparta_tf.dp_step.noise`,
the draws DP-SGD adds), step ``t`` adds ``w_t`` by forward substitution::

    w_t = (z_t - sum_{s in R, 0 < t - s < b} c_{t-s} w_s) / c_0

over the earlier steps ``s`` whose noise the selection holds (``R``), by their global step number. The
released noisy gradients are then ``C_R^{-1} (C_R G + Z)`` with ``C_R`` the principal submatrix of ``C``
on ``R``: post-processing of a matrix mechanism whose columns have norm at most 1 and whose rows
``b`` or more steps apart are disjoint, so an example that takes part only in steps ``b`` apart (cyclic
Poisson sampling, :mod:`sparta_tf.privacy.sampling`) changes disjoint rows with sensitivity ``C_clip``
each (:mod:`sparta_tf.privacy.banded`). ``b = 1`` is ``w_t = z_t``: independent noise.

**Plain steps.** With a sampling ``layout`` (:mod:`sparta_tf.privacy.layout`), a step it samples plainly
(every example at ``q``, charged as one run of DP-SGD) must not add banded noise: an example there is not
kept to steps ``b`` apart, so the rows of its gradient would not be disjoint. Such a step is refused by a
``tf.debugging`` assertion before anything is added or kept, whatever release called the noise. Where the
assertion does not run (XLA drops assertions), the step adds ``w_t = z_t`` and keeps it under no step
(``-b``): the independent noise of the plain DP-SGD step the ledger charges, and no band reaches across.

**State.** Per selection of the trainable set, the last ``b - 1`` noise tensors ``w_s`` (compact shape:
trainable coordinates only, e.g. SPARTA's selected rows) and their global steps ``s`` (``-b``: none).
:meth:`CorrelatedNoise.build` keeps the state of selections that stay identical, as the masked
optimizer keeps its slots, and starts new ones empty; steps that release something else (a selection
epoch's scores) leave it, and a buffered ``w_s`` from ``b`` or more steps back has coefficient 0. The
state is part of the DP model's checkpoint, so a resumed run adds exactly the noise an uninterrupted
run would have added. Memory: ``b - 1`` times the trainable coordinates, in the sums' dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import tensorflow as tf

from sparta_tf.dp_step.noise import noise_draws
from sparta_tf.optim.masked_optimizer import selection_keys
from sparta_tf.precision import accumulation_dtype
from sparta_tf.privacy.banded import BandedFactorization
from sparta_tf.trainable import TrainableSet

if TYPE_CHECKING:
    from sparta_tf.privacy.layout import SamplingLayout


def noise_buffer_bytes(bands: int, coordinates: int, dtype_size: int = 4) -> int:
    """The bytes of the ``b - 1`` buffered draws over ``coordinates`` trainable coordinates (float32: 4
    bytes each); 0 for independent noise (``b = 1``)."""
    return (bands - 1) * int(coordinates) * dtype_size


def _state_variable(initial, name: str) -> tf.Variable:
    """The same value on every replica (every replica computes the same noise)."""
    return tf.Variable(initial, trainable=False, name=name, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


class CorrelatedNoise(tf.Module):
    """``S -> S + w_t`` at step ``t`` with ``w = C^{-1} z`` (module doc), ``sigma`` and ``C_clip`` from
    ``mechanism`` (its ``bands``), ``z`` from the run's noise ``seed``; ``layout``: a callable returning the
    run's :class:`~sparta_tf.privacy.layout.SamplingLayout` (read when the step is traced), whose plain
    steps are refused (module doc), or None: every step cyclic."""

    def __init__(self, mechanism, seed: tf.Variable | tf.Tensor, momentum: float = 0.0,
                 layout: Callable[[], SamplingLayout] | None = None):
        super().__init__(name="correlated_noise")
        self.mechanism = mechanism
        self.seed = seed
        self.layout = layout
        self.bands = mechanism.bands
        self.coefficients = BandedFactorization(self.bands, momentum).coefficients
        self.buffers: dict[str, tf.Variable] = {}  # [b - 1, *compact shape]: w_s, newest first
        self.steps: dict[str, tf.Variable] = {}  # int64 [b - 1]: the global step s of each w_s
        self._keys: list[str] = []

    @property
    def memory_bytes(self) -> int:
        """The bytes the buffered noise takes."""
        return sum(int(np.prod(v.shape.as_list())) * v.dtype.size for v in self.buffers.values())

    def build(self, trainable_set: TrainableSet | Sequence) -> None:
        """Empty state for new selections; unchanged selections keep theirs."""
        selections = list(trainable_set)
        keys = selection_keys(selections)
        depth = self.bands - 1
        buffers, steps = {}, {}
        for selection, key in zip(selections, keys):
            if key in self.buffers:
                buffers[key], steps[key] = self.buffers[key], self.steps[key]
                continue
            dtype = accumulation_dtype(selection.variable.dtype)
            buffers[key] = _state_variable(tf.zeros([depth, *selection.compact_shape], dtype), f"{key}_noise")
            steps[key] = _state_variable(tf.fill([depth], tf.constant(-self.bands, tf.int64)), f"{key}_noise_steps")
        self.buffers, self.steps, self._keys = buffers, steps, keys

    def __call__(self, sums: list, step: tf.Tensor) -> list:
        """``S_k + w_k^t`` for each released tensor (one draw at a time, as :class:`GaussianNoise`)."""
        if len(sums) != len(self._keys):
            raise ValueError(f"{len(sums)} sums for {len(self._keys)} selections; call build() first")
        step, plain = self._refuse_plain(tf.cast(step, tf.int64))
        draws = noise_draws([s.shape for s in sums], self.mechanism.noise_std, self.seed, step,
                            dtype=[s.dtype for s in sums])
        noised: list = []
        for total, draw, key in zip(sums, draws, self._keys):
            with tf.control_dependencies(noised[-1:]):
                noised.append(total + self._correlated(draw(), step, key, plain))
        return noised

    def _refuse_plain(self, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor | None]:
        """``step`` behind an assertion that the layout does not sample it plainly, and whether it does
        (a bool scalar; None when the layout has no plain steps)."""
        layout = None if self.layout is None or self.bands == 1 else self.layout()
        if layout is None or not layout.plain:
            return step, None
        plain = layout.plain_mask(step)
        refusal = (f"banded noise (bands={self.bands}) in a step that the sampling layout samples plainly "
                   f"(steps {list(layout.plain)}): only a release without it (a selection epoch's) may run there; "
                   "run gradient steps outside them (plan the run's phases with make_private)")
        check = tf.debugging.Assert(tf.logical_not(plain), [refusal, "step", step])
        with tf.control_dependencies([check]):
            return tf.identity(step), plain

    def _correlated(self, z: tf.Tensor, step: tf.Tensor, key: str, plain: tf.Tensor | None) -> tf.Tensor:
        """``w_t`` of one selection, and its state shifted to hold it (where ``plain``: ``z_t``, kept under
        no step; module doc)."""
        if self.bands == 1:
            return z
        buffer, steps = self.buffers[key], self.steps[key]
        lag = step - steps.read_value()  # [b - 1]
        padded = tf.constant(np.append(self.coefficients, 0.0), z.dtype)  # c_0 .. c_{b-1}, then 0
        in_band = (lag > 0) & (lag < self.bands)
        c_0, kept_as = tf.cast(self.coefficients[0], z.dtype), step
        if plain is not None:
            in_band = in_band & tf.logical_not(plain)
            c_0 = tf.where(plain, tf.constant(1.0, z.dtype), c_0)
            kept_as = tf.where(plain, tf.constant(-self.bands, tf.int64), step)
        weights = tf.gather(padded, tf.where(in_band, lag, self.bands))  # c_{t-s}, 0 out of the band
        past = tf.tensordot(weights, buffer.read_value(), axes=1)
        w = (z - past) / c_0
        with tf.control_dependencies([w]):
            buffer.assign(tf.concat([w[None], buffer[:-1]], axis=0))
            steps.assign(tf.concat([kept_as[None], steps[:-1]], axis=0))
        return tf.identity(w)
