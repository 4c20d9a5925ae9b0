"""``SamplingLayout``: how each DP step of a run samples, read by the sampler and by the ledger's charge.

With independent noise (``bands = 1``) every step Poisson-samples every example at ``q`` and is charged
as one run of ``M_{q, sigma}``. With BandMF's correlated noise (``bands = b > 1``,
:mod:`sparta_tf.privacy.banded`) the steps that release a *gradient* sample cyclically: step ``t``
samples the examples of group ``t mod b`` at ``q_b = b q``, and ``T`` consecutive such steps are
charged as ``ceil(T / b)`` runs of ``M_{q_b, sigma}``. A step that releases something else with its
own, independent noise (SPARTA's selection epoch: one Gaussian release of scores per step, no weight
updated, no correlated noise) gains nothing from cyclic sampling and loses amplification by it, so it
samples *plainly*: every example at ``q``, charged as one run of ``M_{q, sigma}``.

The layout names those plain steps: half-open ranges ``[start, stop)`` of global DP steps (the model's
``dp_step``). Privacy of the whole run, for one added example ``x`` whose group ``g`` is fixed (and then
for the uniform ``g`` by joint convexity):

* in a cyclic range, ``x`` takes part only in steps ``t = g (mod b)``, each with probability ``q_b``,
  and its gradient at ``t`` enters the rows ``t .. t + b - 1`` of the banded release that lie in the
  same cyclic range: each plain range is at least ``b`` steps long (:meth:`SamplingLayout.check`), and
  the correlated noise of a step reaches back over global steps (:mod:`sparta_tf.dp_step.correlated_noise`:
  coefficient 0 at ``b`` or more steps), so no band reaches across a plain range;
* in a plain range, ``x`` takes part in each step with probability ``q``, released with fresh noise.

The run is then the adaptive composition, in time order, of ``ceil(T_r / b)`` runs of
``M_{q_b, sigma}`` per cyclic range of ``T_r`` steps (Choquette-Choo et al. 2023, Thm. 4, per range)
and one run of ``M_{q, sigma}`` per plain step: exactly what :meth:`SamplingLayout.charges` records.
A gradient step inside a plain range would break the first point, so it is refused before it runs
(:meth:`SamplingLayout.check_gradient_steps`), and the correlated noise refuses to run in a plain step
whatever release calls it (:mod:`sparta_tf.dp_step.correlated_noise`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

from sparta_tf import keras_trainer
from sparta_tf.privacy.banded import check_bands
from sparta_tf.privacy.ledger import LedgerEntry

Range = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class SamplingLayout:
    """``bands`` and the ranges ``plain`` of global DP steps that sample every example at ``q``; every
    other step samples its group cyclically (module doc). ``plain`` is empty with ``bands = 1``, where
    the two are the same."""

    bands: int = 1
    plain: tuple[Range, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "bands", check_bands(self.bands))
        ranges = tuple(sorted((int(start), int(stop)) for start, stop in self.plain if stop > start))
        object.__setattr__(self, "plain", () if self.bands == 1 else ranges)
        self.check()

    def check(self) -> None:
        """ValueError for overlapping ranges or one shorter than ``bands`` (a band could reach across it)."""
        for (start, stop), following in zip(self.plain, self.plain[1:] + ((None, None),)):
            if start < 0 or stop - start < self.bands:
                raise ValueError(f"plain steps [{start}, {stop}) with bands={self.bands}: a plain range must "
                                 f"start at a step >= 0 and last at least {self.bands} steps")
            if following[0] is not None and following[0] < stop:
                raise ValueError(f"plain step ranges [{start}, {stop}) and {list(following)} overlap")

    @classmethod
    def of_phases(cls, phases: Sequence, steps_per_epoch: int, bands: int, first_step: int = 0) -> SamplingLayout:
        """The layout of a run whose phases (``epochs`` each, ``updates`` False for a phase that releases
        no gradient) start at global step ``first_step``, ``steps_per_epoch`` steps an epoch."""
        plain, start = [], int(first_step)
        for phase in phases:
            stop = start + phase.epochs * steps_per_epoch
            if not phase.updates:
                plain.append((start, stop))
            start = stop
        return cls(bands, tuple(plain))

    def sampler_arguments(self) -> str:
        """The layout as :class:`~sparta_tf.privacy.sampling.PoissonSampler`'s arguments after its rate
        (``", bands=b, plain_steps=[...]"``; empty with one band), for messages and ``repr``."""
        return (("" if self.bands == 1 else f", bands={self.bands}")
                + ("" if not self.plain else f", plain_steps={list(self.plain)}"))

    # ------------------------------------------------------------------ which steps

    def is_plain(self, step: int) -> bool:
        return any(start <= step < stop for start, stop in self.plain)

    def plain_mask(self, step: tf.Tensor) -> tf.Tensor:
        """Bool scalar: global step ``step`` (an int64 tensor) samples plainly."""
        step = tf.cast(step, tf.int64)
        plain = tf.constant(False)
        for start, stop in self.plain:
            plain = plain | ((step >= start) & (step < stop))
        return plain

    def segments(self, first_step: int, steps: int) -> list[tuple[int, bool]]:
        """``[(count, plain), ...]``: the steps ``first_step .. first_step + steps - 1`` in runs of one kind."""
        segments, step, end = [], int(first_step), int(first_step) + int(steps)
        while step < end:
            plain = self.is_plain(step)
            boundary = min([b for s, e in self.plain for b in (s, e) if b > step] + [end])
            segments.append((boundary - step, plain))
            step = boundary
        return segments

    # ------------------------------------------------------------------ what they cost

    def charges(self, mechanism, first_step: int | None, steps: int, phase: str | None = None,
                kind: str | None = None) -> list[LedgerEntry]:
        """The ledger entries of ``steps`` consecutive DP steps of ``mechanism`` (a
        :class:`~sparta_tf.privacy.mechanism.DpSgdMechanism`) from global step ``first_step``: a cyclic
        run as ``mechanism.entry``, a plain run as ``mechanism``'s plain entry. ``first_step=None``
        (steps not known exactly, e.g. those a killed run started): every step charged both ways, an
        over-count."""
        options = {} if kind is None else {"kind": kind}
        if not self.plain:
            return [mechanism.entry(steps, phase, **options)]
        if first_step is None:
            return [mechanism.entry(steps, phase, **options), mechanism.plain_entry(steps, phase, **options)]
        return [mechanism.plain_entry(count, phase, **options) if plain else mechanism.entry(count, phase, **options)
                for count, plain in self.segments(first_step, steps)]

    def check_gradient_steps(self, first_step: int, steps: int) -> None:
        """ValueError when gradient steps ``first_step .. first_step + steps - 1`` (correlated noise) would
        run inside a plain range, whose sampling does not keep an example's steps ``b`` apart."""
        inside = [(start, stop) for start, stop in self.plain if first_step < stop and start < first_step + steps]
        if inside:
            raise ValueError(f"gradient steps {first_step}..{first_step + steps - 1} would run in the plainly sampled "
                             f"steps {list(inside[0])} of bands={self.bands}; only a phase that releases no gradient "
                             "(a selection epoch) may run there: plan the run's phases with make_private")


class PlainStepsGuard(tf.keras.callbacks.Callback):
    """Before each step of a DP model's ``fit``: refuses (ValueError, before the step runs) a gradient
    release in the steps its :attr:`~sparta_tf.DPModel.sampling_layout` samples plainly."""

    def __init__(self, dp):
        super().__init__()
        self.dp = dp

    def on_train_batch_begin(self, batch, logs=None):
        if self.dp.releases_gradient:
            self.dp.sampling_layout.check_gradient_steps(int(self.dp.dp_step.numpy()),
                                                         keras_trainer.steps_per_execution(self.dp))
