"""``PrivacyPlan``: the privacy side of a run, computed once, printed by the dry run, followed by the run.

A run of ``T`` epochs on ``n`` private examples with expected batch ``b`` is

* ``q = min(1, b / n)``, ``s = round(1 / q)`` DP steps per epoch, ``T s``
  steps in all, grouped into the method's phases (``warmup``, ``selection``,
  ``sparse``, ...); every step, whether it updates weights or releases
  SPARTA's selection scores, is one Poisson-subsampled Gaussian mechanism
  ``M_{q, sigma}`` (:mod:`sparta_tf.privacy.accounting`);
* plus the mechanisms a method runs *before* training (DP-SNIP's release,
  DP-FROST's selection rounds, the selection epoch of a loaded mask), each
  ``M_{q_k, sigma_k}`` run ``count_k`` times.

Noise multipliers, by one calibrator
(:func:`sparta_tf.privacy.calibration.calibrate_composition`):

1. the training ``sigma``: given, or the smallest with
   ``eps(before-training mechanisms with a known sigma  o  training) <= share * target``
   (``share = 1`` except DP-FROST's ``r_eps``, where the known mechanisms
   are left out);
2. then every before-training mechanism whose ``sigma`` is not given: the
   smallest with ``eps(everything) <= target``.

:meth:`PrivacyPlan.events` lists the ledger entries a run must record, in
order; a finished run's ledger equals them (tested for every method), so the
plan's ``epsilon after`` each phase is what the ledger will report.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from sparta_tf.method_spec import Phase
from sparta_tf.privacy import accounting, banded, calibration
from sparta_tf.privacy import tuning as tuning_privacy
from sparta_tf.privacy.tuning import Repetition
from sparta_tf.privacy.layout import SamplingLayout
from sparta_tf.privacy.ledger import DEFAULT_KIND, LedgerEntry, PrivacyLedger
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.privacy.rates import cyclic_sample_rate, sample_rate  # noqa: F401 -- the plan's rates
from sparta_tf.privacy.sampling import steps_per_epoch


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """``count`` runs of ``M_{q, sigma}`` labelled ``phase`` / ``kind``; ``sigma=None``: to be calibrated.
    ``draws_noise=False``: a recorded cost, not a new release (a loaded mask's provenance, charged
    again by every run that loads the mask). ``bands``: ``count`` steps of a banded mechanism (a mask
    chosen under BandMF), charged as :attr:`compositions` runs."""

    phase: str
    sample_rate: float
    count: int
    noise_multiplier: float | None = None
    kind: str = DEFAULT_KIND
    draws_noise: bool = True
    bands: int = 1

    @property
    def compositions(self) -> int:
        """``ceil(count / bands)`` (:attr:`~sparta_tf.privacy.ledger.LedgerEntry.compositions`)."""
        return banded.reduced_steps(self.count, self.bands)

    def entry(self) -> LedgerEntry:
        if self.noise_multiplier is None:
            raise ValueError(f"mechanism {self.phase!r} has no noise multiplier yet")
        return LedgerEntry(self.noise_multiplier, self.sample_rate, self.count, self.kind, self.phase, self.bands)


@dataclasses.dataclass(frozen=True)
class PrivacyPlan:
    """Everything about a run's privacy that is known before it starts (see the module doc)."""

    n: int
    sample_rate: float
    steps_per_epoch: int
    epochs: int
    noise_multiplier: float
    delta: float
    target_epsilon: float | None
    accountant: str
    before_training: tuple[Mechanism, ...]
    phases: tuple[Phase, ...]
    """The training phases, planned (:meth:`~sparta_tf.method_spec.Phase.planned`: with ``steps`` and
    ``epsilon_after``)."""
    nonprivate_reasons: tuple[str, ...] = ()
    tuning: Repetition | None = None
    """A private tuning's candidate: the noise multipliers are calibrated so that ``tuning`` of this run's
    events (the whole procedure) meets ``target_epsilon``; each phase's ``epsilon_after`` is the run's own."""
    bands: int = 1
    """``b``: the training's noise is ``b``-banded correlated (BandMF, :mod:`sparta_tf.privacy.banded`) under
    cyclic Poisson sampling at :attr:`group_sample_rate`; 1: independent noise (DP-SGD)."""
    unit: str = "example"
    """What the guarantee protects: ``"example"``, or ``"user"`` (``n`` and the batch count users,
    :mod:`sparta_tf.dp_step.user_units`)."""

    @property
    def group_sample_rate(self) -> float:
        """The rate a DP step samples (its group's examples, ``b q``, with bands; ``q`` without)."""
        return cyclic_sample_rate(self.sample_rate, self.bands)

    @property
    def run_budget(self) -> float | None:
        """The budget a run of this plan keeps: ``target_epsilon``, or a tuning candidate's own epsilon
        (its share of the tuning: a resumed candidate stops before it spends more than planned)."""
        return self.epsilon if self.tuning is not None and self.private else self.target_epsilon

    @property
    def tuned_epsilon(self) -> float | None:
        """The whole tuning's epsilon (RDP) when the plan is a tuning candidate's, else None."""
        if self.tuning is None:
            return None
        return tuning_privacy.epsilon_of_tuning(self.events(), self.tuning, self.delta)

    @property
    def steps(self) -> int:
        """DP steps of training (every phase)."""
        return self.steps_per_epoch * self.epochs

    @property
    def update_steps(self) -> int:
        """Training steps that update weights (a selection epoch releases scores instead): the
        length a learning-rate schedule must cover, since only these advance ``optimizer.iterations``."""
        return sum(p.steps for p in self.phases if p.updates)

    @property
    def private(self) -> bool:
        return not self.nonprivate_reasons

    @property
    def epsilon(self) -> float:
        """Epsilon after the whole run (``inf`` when not private)."""
        return self.phases[-1].epsilon_after if self.phases else 0.0

    def events(self) -> list[LedgerEntry]:
        """The ledger entries the run records, in order (consecutive equal keys merged)."""
        ledger = PrivacyLedger(self.delta, accountant=self.accountant)
        for entry in self._entries():
            ledger.charge(entry)
        return list(ledger.entries)

    def before_training_entries(self, releases_only: bool = False) -> list[LedgerEntry]:
        """The ledger entries of the mechanisms before the first DP step (``releases_only``: only
        those that draw noise, i.e. release something new each time they run)."""
        return [m.entry() for m in self.before_training if m.count and (m.draws_noise or not releases_only)]

    def sampling_layout(self, first_step: int = 0) -> SamplingLayout:
        """How each step samples (:mod:`sparta_tf.privacy.layout`), the first training step being global
        DP step ``first_step``."""
        return SamplingLayout.of_phases(self.phases, self.steps_per_epoch, self.bands, first_step)

    def _entries(self) -> list[LedgerEntry]:
        mechanism = DpSgdMechanism(self.noise_multiplier, self.sample_rate, bands=self.bands)
        per_phase = phase_charges(self.phases, self.sampling_layout(), mechanism)
        return self.before_training_entries() + [entry for entries in per_phase for entry in entries]

    def to_json(self) -> dict:
        tuning = None if self.tuning is None else self.tuning.to_dict() | {"epsilon": self.tuned_epsilon}
        return dataclasses.asdict(self) | {"steps": self.steps, "update_steps": self.update_steps,
                                           "private": self.private, "tuning": tuning,
                                           "events": [e.to_dict() for e in self.events()]}

    def describe(self, trainable: Mapping[str, int | None] | None = None, total_parameters: int | None = None) -> str:
        """The plan as the dry run prints it; ``trainable``: coordinates trained per phase
        (None: chosen privately during the run) out of ``total_parameters``."""
        target = "none" if self.target_epsilon is None else f"{self.target_epsilon:g}"
        if self.tuning is not None:
            target += " for the whole tuning"
        lines = [
            f"private training examples n = {self.n}" if self.unit == "example" else
            f"private training users n = {self.n} (privacy unit: one user, all of their examples)",
            f"sample rate q = {self.sample_rate:.6g} (expected batch {self.sample_rate * self.n:.1f}), "
            f"{self.steps_per_epoch} steps/epoch, {self.epochs} epochs = {self.steps} steps",
            f"noise multiplier sigma = {self.noise_multiplier:.6g} "
            f"(target epsilon {target}, delta {self.delta:g}, {self.accountant})",
        ]
        if self.bands > 1:
            lines.append(f"correlated noise: {self.bands} bands (BandMF), cyclic Poisson sampling of 1 group of "
                         f"{self.bands} per step at rate {self.group_sample_rate:.6g}")
            plain = [p.name for p in self.phases if not p.updates]
            if plain:
                lines.append(f"  {', '.join(plain)}: no gradient released, so independent noise and every example "
                             f"sampled at q = {self.sample_rate:.6g}")
        for mechanism in self.before_training:
            lines.append(f"before training: {mechanism.phase}: {mechanism.count} x {mechanism.kind} "
                         f"(q = {mechanism.sample_rate:.4g}, sigma = {mechanism.noise_multiplier:.6g})")
        lines += [f"NOT differentially private: {reason}" for reason in self.nonprivate_reasons]
        lines.append("phase          epochs   trainable parameters        epsilon at end")
        for phase in self.phases:
            lines.append(f"{phase.name:<14} {phase.epochs:>6}   {_trainable(phase, trainable, total_parameters):<27} "
                         f"{phase.epsilon_after:.4g}")
        return "\n".join(lines)


def _trainable(phase: Phase, trainable, total) -> str:
    if not phase.updates:
        return "0 (scores only)"
    count = (trainable or {}).get(phase.name)
    if count is None:
        return "selected privately" if trainable is not None else "-"
    return f"{count:,} ({count / total:.2%})" if total else f"{count:,}"


def phase_charges(phases: Sequence[Phase], layout: SamplingLayout,
                  mechanism: DpSgdMechanism) -> list[list[LedgerEntry]]:
    """The ledger entries of each planned phase (with ``steps``), in order, as ``layout`` charges them
    (none for a phase without steps)."""
    charges, step = [], 0
    for phase in phases:
        charges.append(layout.charges(mechanism, step, phase.steps, phase.name) if phase.steps else [])
        step += phase.steps
    return charges


def banded_compositions(steps_per_phase: Sequence[int], bands: int) -> tuple[int, ...]:
    """``ceil(T_p / b)`` for each phase of ``T_p`` steps (one ledger entry each): the compositions the
    reduction charges (ValueError when a phase with steps has fewer than ``b``: its noise could not
    cancel, and its charge would round up to a whole cycle)."""
    bands = banded.check_bands(bands)
    short = [steps for steps in steps_per_phase if 0 < steps < bands]
    if bands > 1 and short:
        raise ValueError(f"bands={bands} is more than the {short[0]} steps of a phase: lower bands to at most "
                         f"{min(short)} or train that phase longer")
    return tuple(banded.reduced_steps(steps, bands) for steps in steps_per_phase)


def make_privacy_plan(
    *,
    n: int,
    expected_batch_size: float,
    phases: Sequence[Phase],
    delta: float,
    target_epsilon: float | None,
    accountant: str = "pld",
    noise_multiplier: float | None = None,
    before_training: Sequence[Mechanism] = (),
    training_share: float = 1.0,
    nonprivate_reasons: Sequence[str] = (),
    tuning: Repetition | None = None,
    bands: int = 1,
    unit: str = "example",
) -> PrivacyPlan:
    """Calibrates every noise multiplier of a run and the epsilon after each phase (module doc).

    ``bands = b > 1``: every DP step that releases a gradient samples one of ``b`` groups at ``q_b = b q``
    (:func:`cyclic_sample_rate`) and each phase of ``T_p`` such steps is charged ``ceil(T_p / b)`` steps of
    ``M_{q_b, sigma}`` (:func:`banded_compositions`); a phase that releases no gradient (a selection epoch)
    samples every example at ``q`` and is charged ``T_p`` steps of ``M_{q, sigma}``
    (:mod:`sparta_tf.privacy.layout`).

    ``tuning``: the run is one candidate of a private tuning (:class:`~sparta_tf.privacy.tuning.Repetition`):
    every noise multiplier is calibrated so that the tuning around the run meets ``target_epsilon`` (RDP,
    the accountant of ``RepeatAndSelectDpEvent``; the training's steps calibrated as one composition, so
    candidates that split their phases differently get the same noise).

    A given ``noise_multiplier`` with a ``target_epsilon`` must meet it: :class:`FixedNoiseOverBudgetError`
    otherwise, at once (before the per-phase PLD work, which takes minutes at ``sigma = 0.01``) when one
    step alone spends more than the target.
    """
    unsized = [p.name for p in phases if p.epochs is None]
    if unsized:
        raise ValueError(f"phase {unsized[0]!r} has no epochs: plan a fit's phases (Method.phases(epochs)), "
                         "not a spec's templates")
    q = sample_rate(n, expected_batch_size)
    per_epoch = steps_per_epoch(q)
    epochs = sum(p.epochs for p in phases)
    step_rate = cyclic_sample_rate(q, bands)
    banded_compositions([p.epochs * per_epoch for p in phases], bands)  # refuses a phase shorter than b
    phases = [p.planned(p.epochs * per_epoch, 0.0) for p in phases]
    layout = SamplingLayout.of_phases(phases, per_epoch, bands)
    charges = phase_charges(phases, layout, DpSgdMechanism(1.0, q, bands=bands))  # rates and counts; sigma below
    training = tuple((entry.sample_rate, entry.compositions) for entries in charges for entry in entries)
    if tuning is not None:
        if noise_multiplier is not None or target_epsilon is None:
            raise ValueError("a tuning candidate's plan calibrates its noise from the tuning's target_epsilon: "
                             "give the target, not a noise multiplier")
        rates = sorted({rate for rate, _ in training})
        accountant = tuning_privacy.ACCOUNTANT
        training = tuple((rate, sum(count for r, count in training if r == rate)) for rate in rates)
    given = noise_multiplier is not None and target_epsilon is not None and not nonprivate_reasons
    if noise_multiplier is None:
        if target_epsilon is None:
            raise ValueError("give a target epsilon or a noise multiplier")
        known = () if training_share < 1 else _known(before_training)
        noise_multiplier = calibration.calibrate_composition(
            known, training, training_share * target_epsilon, delta, accountant, wrap=tuning)
    if given:
        steps = [(noise_multiplier, step_rate)] if training else []
        steps += [(sigma, rate) for sigma, rate, _ in _known(before_training)]
        bound = max((accounting.step_epsilon_lower_bound(s, rate, delta) for s, rate in steps), default=0.0)
        if bound > target_epsilon:
            raise FixedNoiseOverBudgetError(noise_multiplier, target_epsilon,
                                            f"epsilon > {bound:.4g} (one step alone, at delta={delta:g})")
    before = tuple(_calibrated_before(before_training, noise_multiplier, training, target_epsilon, delta, accountant,
                                      tuning))
    ledger = PrivacyLedger(delta, accountant=accountant)
    for reason in nonprivate_reasons:
        ledger.record_nonprivate(reason)
    for mechanism in before:
        ledger.charge(mechanism.entry())
    planned = []
    for phase, entries in zip(phases, phase_charges(phases, layout, DpSgdMechanism(noise_multiplier, q, bands=bands))):
        for entry in entries:
            ledger.charge(entry)
        planned.append(phase.planned(phase.steps, ledger.epsilon()))
    plan = PrivacyPlan(n, q, per_epoch, epochs, float(noise_multiplier), delta, target_epsilon, accountant,
                       before, tuple(planned), tuple(nonprivate_reasons), tuning, banded.check_bands(bands), unit)
    if given and plan.epsilon > target_epsilon * (1 + 1e-9):
        raise FixedNoiseOverBudgetError(noise_multiplier, target_epsilon, f"epsilon={plan.epsilon:.4g}")
    return plan


class FixedNoiseOverBudgetError(accounting.PrivacyBudgetExceededError):
    """A given noise multiplier spends more than the target epsilon over the planned run. ``spent`` says
    how much: the plan's epsilon, or (found in microseconds, before any PLD work) a lower bound from one
    step alone (:func:`~sparta_tf.privacy.accounting.step_epsilon_lower_bound`)."""

    def __init__(self, noise_multiplier: float, target_epsilon: float, spent: str):
        self.noise_multiplier, self.target_epsilon, self.spent = noise_multiplier, target_epsilon, spent
        super().__init__(f"noise_multiplier={noise_multiplier:g} spends {spent} over the planned run, more than "
                         f"target_epsilon={target_epsilon:g}; raise it, or give none to calibrate it from the target")


def calibrate_split(target_epsilon: float, delta: float, share: float, *, sample_rate: float, steps: int,
                    before_rate: float, before_count: int, accountant: str = "pld",
                    rtol: float = calibration.CALIBRATION_RTOL) -> tuple[float, float]:
    """``(sigma_before, sigma_training)`` of a budget split by ``share`` (DP-FROST's ``r_eps``):
    ``sigma_training`` the smallest with ``eps(M_{q, sigma}^steps) <= share * target``, then
    ``sigma_before`` the smallest with ``eps(training o M_{q_b, sigma_before}^count) <= target``
    (what :func:`make_privacy_plan` does with ``training_share``, for callers without a plan)."""
    training = calibration.calibrate_noise_multiplier(share * target_epsilon, delta, sample_rate, steps, accountant,
                                                      rtol)
    before = calibration.calibrate_composition(((training, sample_rate, steps),), ((before_rate, before_count),),
                                               target_epsilon, delta, accountant, rtol)
    return float(before), float(training)


def _known(mechanisms: Sequence[Mechanism]) -> tuple:
    return tuple((m.noise_multiplier, m.sample_rate, m.compositions) for m in mechanisms
                 if m.noise_multiplier is not None and m.count)


def _calibrated_before(before: Sequence[Mechanism], sigma: float, training: tuple, target: float | None,
                       delta: float, accountant: str, tuning: Repetition | None = None):
    """``before`` with every missing noise multiplier calibrated to fill the budget."""
    unknown = tuple((m.sample_rate, m.compositions) for m in before if m.noise_multiplier is None)
    if not unknown:
        return list(before)
    if target is None:
        raise ValueError("a mechanism before training has no noise multiplier and there is no target epsilon")
    fixed = _known(before) + tuple((sigma, q, count) for q, count in training)
    calibrated = calibration.calibrate_composition(fixed, unknown, target, delta, accountant, wrap=tuning)
    return [m if m.noise_multiplier is not None else dataclasses.replace(m, noise_multiplier=calibrated)
            for m in before]
