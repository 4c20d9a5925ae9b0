"""``DpSgdMechanism``: the one frozen description of what every DP step of a run is.

A DP step on ``n`` private examples is the Poisson-subsampled Gaussian mechanism::

    B_t ~ Poisson(q) over the n examples,   S_t = sum_{i in B_t} clip_C(g_i),
    release  (S_t + N(0, sigma^2 C^2 I)) / (q n)

with per-example L2 bound ``C`` (the sensitivity), noise multiplier ``sigma``, sample rate ``q``,
reported at ``delta``. Its privacy cost depends on ``(sigma, q)`` only:
``dp_event(steps) = SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)``.

With ``bands = b > 1`` (BandMF, :mod:`sparta_tf.privacy.banded`) the noise of the gradient steps is
``b``-banded correlated and the steps sample under cyclic Poisson sampling: step ``t`` samples the
examples of group ``t mod b`` at ``q_b = b q`` (:attr:`DpSgdMechanism.step_sample_rate`), so the expected
batch stays ``q n`` and ``T`` steps cost ``ceil(T / b)`` runs of ``M_{q_b, sigma}``; the steps that release
no gradient (a selection epoch) sample every example at ``q`` and cost one run of ``M_{q, sigma}`` each
(:meth:`DpSgdMechanism.plain_entry`; which steps are which: :mod:`sparta_tf.privacy.layout`).

The values come from the run's :class:`~sparta_tf.privacy.plan.PrivacyPlan`
(:meth:`DpSgdMechanism.of_plan`), or from a bare :class:`~sparta_tf.DPModel`'s arguments, once;
the DP model's noise, normalisation, sampler and selection scorer read them from this object,
and the ledger charges ``entry(steps)`` of the same object for the steps its counter counted
(:mod:`sparta_tf.privacy.charging`), so what is charged is exactly what ran.
"""

from __future__ import annotations

import dataclasses
import math

import dp_accounting

from sparta_tf.privacy import accounting
from sparta_tf.privacy.banded import check_bands, reduced_steps
from sparta_tf.privacy.ledger import DEFAULT_KIND, LedgerEntry
from sparta_tf.privacy.rates import cyclic_sample_rate


@dataclasses.dataclass(frozen=True)
class DpSgdMechanism:
    """``M_{q, sigma}`` with clip norm ``C`` on ``n`` examples, reported at ``delta`` (module doc).

    ``dataset_size=None``: ``n`` is taken from the arrays of the first ``fit``
    (:meth:`with_dataset_size`); ``delta=None``: no accounting (no ledger)."""

    noise_multiplier: float
    sample_rate: float
    clip_norm: float = 1.0
    dataset_size: int | None = None
    delta: float | None = None
    bands: int = 1

    def __post_init__(self) -> None:
        set_field = lambda name, value: object.__setattr__(self, name, value)
        set_field("noise_multiplier", accounting.check_noise_multiplier(self.noise_multiplier))
        set_field("sample_rate", accounting.check_sample_rate(self.sample_rate))
        set_field("bands", check_bands(self.bands))
        self.step_sample_rate  # noqa: B018 -- refuses b q > 1 here, not at the first step
        if not (isinstance(self.clip_norm, (int, float)) and self.clip_norm > 0 and math.isfinite(self.clip_norm)):
            raise ValueError(f"clip_norm={self.clip_norm!r} must be a finite number > 0")
        set_field("clip_norm", float(self.clip_norm))
        if self.dataset_size is not None:
            set_field("dataset_size", accounting.check_steps(self.dataset_size, "dataset_size"))
            if self.dataset_size < 1:
                raise ValueError("dataset_size=0: need at least 1 private training example")
        if self.delta is not None:
            set_field("delta", accounting.check_delta(self.delta))
            if self.dataset_size is not None:
                accounting.check_delta_for_dataset(self.delta, self.dataset_size)

    @classmethod
    def of_plan(cls, plan, clip_norm: float = 1.0) -> "DpSgdMechanism":
        """The training mechanism of ``plan`` (a :class:`~sparta_tf.privacy.plan.PrivacyPlan`) with
        clip norm ``C``: its ``sigma``, ``q``, ``n`` and ``delta``."""
        return cls(plan.noise_multiplier, plan.sample_rate, clip_norm, plan.n, plan.delta, plan.bands)

    @property
    def step_sample_rate(self) -> float:
        """The rate at which a step samples an example of the group it samples: ``q`` (one group), or
        ``b q`` under cyclic Poisson sampling (:func:`~sparta_tf.privacy.rates.cyclic_sample_rate`)."""
        return cyclic_sample_rate(self.sample_rate, self.bands)

    @property
    def noise_std(self) -> float:
        """``sigma C``: the noise standard deviation on each coordinate of the clipped sum."""
        return self.noise_multiplier * self.clip_norm

    @property
    def expected_batch_size(self) -> float:
        """``q n``, the divisor of the released sum (ValueError while ``n`` is unknown)."""
        if self.dataset_size is None:
            raise ValueError("dataset_size is unknown: pass DPModel(dataset_size=n) or fit arrays")
        return self.sample_rate * self.dataset_size

    def with_dataset_size(self, n: int) -> "DpSgdMechanism":
        """This mechanism on ``n`` examples: itself when ``n`` is known and equal; ValueError when it
        is known and differs (the mechanism of a run never changes)."""
        if self.dataset_size == n:
            return self
        if self.dataset_size is not None:
            raise ValueError(f"dataset_size={self.dataset_size} but fit got {n} examples; they must agree")
        return dataclasses.replace(self, dataset_size=n)

    def dp_event(self, steps: int) -> dp_accounting.DpEvent:
        """The dp-accounting event of ``steps`` consecutive runs of this mechanism (``ceil(steps / b)``
        runs of ``M_{q_b, sigma}`` with bands)."""
        return accounting.dp_sgd_event(self.noise_multiplier, self.step_sample_rate, reduced_steps(steps, self.bands))

    def entry(self, steps: int, phase: str | None = None, kind: str = DEFAULT_KIND) -> LedgerEntry:
        """The ledger charge of ``steps`` consecutive runs (its ``as_dp_event()`` is :meth:`dp_event`)."""
        return LedgerEntry(self.noise_multiplier, self.step_sample_rate, steps, kind, phase, self.bands)

    def plain_entry(self, steps: int, phase: str | None = None, kind: str = DEFAULT_KIND) -> LedgerEntry:
        """The ledger charge of ``steps`` runs that sample every example at ``q`` with independent noise
        (with bands, the steps a :class:`~sparta_tf.privacy.layout.SamplingLayout` samples plainly):
        ``steps`` runs of ``M_{q, sigma}``; :meth:`entry` without bands."""
        return LedgerEntry(self.noise_multiplier, self.sample_rate, steps, kind, phase)
