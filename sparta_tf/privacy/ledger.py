"""A persistent record of every mechanism run of a training job, and its epsilon.

The ledger is a list of entries ``(sigma_k, q_k, n_k, kind_k, phase_k)``: the
Poisson-subsampled Gaussian mechanism ``M_{q_k, sigma_k}`` (see
:mod:`sparta_tf.privacy.accounting`) was run ``n_k`` times. The privacy cost
of the job is that of the adaptive composition of all runs::

    event = ComposedDpEvent([SelfComposedDpEvent(M_{q_k, sigma_k}, n_k) for k])
    epsilon_spent = epsilon(event, delta)        # dp_accounting PLD or RDP

``kind`` ("dp_sgd_step", "sparta_selection", ...) and ``phase`` (free text,
e.g. "warmup") do not change the math; they label the report. Consecutive
records with the same ``(sigma, q, kind, phase)`` are merged, so a long run
stays a handful of entries. A run can also be marked non-private
(``record_nonprivate``): its epsilon is then ``inf`` for good.

The ledger survives restarts: ``save(path)`` writes JSON atomically and
``PrivacyLedger.load(path)`` restores it; epsilon is recomputed from the
entries, so a round trip gives bit-identical epsilon.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable, Sequence, Union

import dp_accounting

from sparta_tf.atomic_files import write_atomic
from sparta_tf.privacy import accounting, tuning
from sparta_tf.privacy.accounting import PrivacyBudgetExceededError
from sparta_tf.privacy.banded import check_bands, reduced_steps
from sparta_tf.privacy.tuning import CandidateCount

__all__ = ["LedgerEntry", "PrivacyLedger", "PrivacyBudgetExceededError"]

LEDGER_FORMAT_VERSION = 1
DEFAULT_KIND = "dp_sgd_step"
POISSON = "poisson"
_BUDGET_SLACK = 1e-9  # relative slack on the target (float noise only)


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    """``count`` runs of ``M_{q, sigma}`` labelled ``kind`` / ``phase``.

    ``bands = b > 1``: ``count`` consecutive steps of a ``b``-banded matrix mechanism under cyclic Poisson
    sampling (:mod:`sparta_tf.privacy.banded`), each step sampling its group at rate ``q`` (the group
    rate ``q_b``): in ``count`` consecutive steps an example's group is sampled at most ``ceil(count / b)``
    times, with disjoint noise correlations, so the entry is ``ceil(count / b)`` runs of ``M_{q, sigma}``
    (Choquette-Choo et al. 2023, Thm. 4; :attr:`compositions`)."""

    noise_multiplier: float
    sample_rate: float
    count: int
    kind: str = DEFAULT_KIND
    phase: str | None = None
    bands: int = 1

    def __post_init__(self) -> None:
        # Validate and normalise to plain Python numbers (numpy scalars would not
        # JSON-serialise, and keys must compare equal across restarts).
        set_field = lambda name, value: object.__setattr__(self, name, value)
        set_field("noise_multiplier", accounting.check_noise_multiplier(self.noise_multiplier))
        set_field("sample_rate", accounting.check_sample_rate(self.sample_rate))
        set_field("count", accounting.check_steps(self.count, "count"))
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"kind must be a non-empty string, got {self.kind!r}.")
        if self.phase is not None and not isinstance(self.phase, str):
            raise ValueError(f"phase must be a string or None, got {self.phase!r}.")
        set_field("bands", check_bands(self.bands))

    @property
    def key(self) -> tuple:
        """Entries with equal keys are merged when consecutive (consecutive records are consecutive
        steps, so a banded entry's ``ceil(count / b)`` holds for the merged count too)."""
        return (self.noise_multiplier, self.sample_rate, self.kind, self.phase, self.bands)

    @property
    def compositions(self) -> int:
        """``ceil(count / bands)``: the runs of ``M_{q, sigma}`` the entry is charged as (``count`` when
        ``bands = 1``)."""
        return reduced_steps(self.count, self.bands)

    def as_dp_event(self) -> dp_accounting.DpEvent:
        """``SelfComposedDpEvent(M_{q, sigma}, compositions)``."""
        step = accounting.gaussian_step_event(self.noise_multiplier, self.sample_rate)
        return dp_accounting.SelfComposedDpEvent(step, self.compositions)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.bands == 1:
            del data["bands"]  # independent noise: the format every earlier ledger has
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LedgerEntry:
        return cls(
            noise_multiplier=float(data["noise_multiplier"]),
            sample_rate=float(data["sample_rate"]),
            count=int(data["count"]),
            kind=data.get("kind", DEFAULT_KIND),
            phase=data.get("phase"),
            bands=int(data.get("bands", 1)),
        )


PlannedRun = Union[LedgerEntry, Sequence]
"""A planned run: a :class:`LedgerEntry` or a tuple ``(sigma, q, count[, kind[, phase]])``."""


def _as_entry(planned: PlannedRun) -> LedgerEntry:
    if isinstance(planned, LedgerEntry):
        return planned
    if not isinstance(planned, Sequence) or not 3 <= len(planned) <= 5:
        raise ValueError(
            f"a planned run must be a LedgerEntry or (sigma, q, count[, kind[, phase]]), got {planned!r}."
        )
    return LedgerEntry(*planned)


INTERRUPTED = "interrupted"
"""The phase of the charges for steps a killed run started and its resume runs again."""


def is_interrupted(phase: str | None) -> bool:
    """Whether ``phase`` charges interrupted steps: :data:`INTERRUPTED`, also under a prefix (a loaded mask's
    ``mask:interrupted``: the last ``:``-separated part)."""
    return (phase or "").rsplit(":", 1)[-1] == INTERRUPTED


def _appended(entries: tuple[LedgerEntry, ...], new: LedgerEntry) -> tuple[LedgerEntry, ...]:
    """``entries + (new,)``, merged into the last entry when the keys match, except banded charges of
    interrupted steps (:func:`is_interrupted`): two kills before one checkpoint replay the same steps, not
    consecutive ones, so ``ceil((l1 + l2) / b)`` would under-count ``ceil(l1 / b) + ceil(l2 / b)``."""
    if new.count == 0:
        return entries
    replayed = is_interrupted(new.phase) and new.bands > 1
    if entries and entries[-1].key == new.key and not replayed:
        merged = dataclasses.replace(entries[-1], count=entries[-1].count + new.count)
        return entries[:-1] + (merged,)
    return entries + (new,)


def sampling_caveat(sampling: str, planned: bool = False) -> str | None:
    """What the guarantee does not cover when batches are drawn with ``sampling`` (None for Poisson
    sampling, which the accountant assumes): the ledger's report says it, and with ``planned`` the
    dry-run plan, before the run."""
    if sampling == POISSON:
        return None
    drawn, epsilon = ("are", "the planned epsilon") if planned else ("were", "the epsilon above")
    return (f"batches {drawn} drawn with sampling={sampling!r}; the accountant's guarantee assumes "
            f"Poisson sampling and does not cover fixed-size shuffled batches, so {epsilon} is "
            "not a proven guarantee for this run.")


class PrivacyLedger:
    """Records mechanism runs and reports the epsilon they spend.

    Args:
      delta: the ``delta`` at which epsilon is reported, in (0, 1).
      accountant: ``"pld"`` (default) or ``"rdp"``, see
        :mod:`sparta_tf.privacy.accounting`.
      target_epsilon: the budget; ``None`` means no budget (report only).
      sampling: how batches were drawn. ``"poisson"`` is what the accountant
        assumes; any other name (e.g. ``"shuffle"``) is recorded and the
        report states that the guarantee does not cover it.
      unit: what a neighbouring dataset adds or removes: ``"example"`` (default) or ``"user"``
        (all of one person's examples; user-level DP, :mod:`sparta_tf.dp_step.user_units`).
    """

    def __init__(
        self,
        delta: float,
        accountant: str = "pld",
        target_epsilon: float | None = None,
        sampling: str = POISSON,
        unit: str = "example",
    ) -> None:
        self.unit = check_unit(unit)
        self.delta = accounting.check_delta(delta)
        self.accountant = accounting.check_accountant(accountant)
        self.target_epsilon = target_epsilon
        if not isinstance(sampling, str) or not sampling:
            raise ValueError(f"sampling must be a non-empty string such as 'poisson', got {sampling!r}.")
        self.sampling = sampling
        self._entries: tuple[LedgerEntry, ...] = ()
        self._nonprivate: list[str] = []
        self._caveats: list[str] = []
        self._tuning: CandidateCount | None = None

    @property
    def target_epsilon(self) -> float | None:
        """The budget (``None``: no budget); settable, e.g. to extend a run's budget."""
        return self._target_epsilon

    @target_epsilon.setter
    def target_epsilon(self, value: float | None) -> None:
        self._target_epsilon = None if value is None else accounting.check_target_epsilon(value)

    # ------------------------------------------------------------------ record

    def record(
        self,
        noise_multiplier: float,
        sample_rate: float,
        count: int = 1,
        kind: str = DEFAULT_KIND,
        phase: str | None = None,
        bands: int = 1,
    ) -> None:
        """Records ``count`` runs of ``M_{q, sigma}`` (``count = 0`` records nothing; ``bands``: see
        :class:`LedgerEntry`)."""
        if noise_multiplier is None:
            raise ValueError(
                "noise_multiplier must be a finite number >= 0, got None; "
                "use record_nonprivate(reason) for a step without noise accounting."
            )
        self.charge(LedgerEntry(noise_multiplier, sample_rate, count, kind, phase, bands))

    def charge(self, entry: LedgerEntry) -> None:
        """Records ``entry`` (e.g. ``mechanism.entry(steps)``; ``count = 0`` records nothing)."""
        self._entries = _appended(self._entries, entry)

    def record_caveat(self, caveat: str) -> None:
        """Records what keeps epsilon from being a proven guarantee without making the run
        non-private (e.g. a loaded mask chosen from shuffled batches); :meth:`caveats` lists it."""
        if not isinstance(caveat, str) or not caveat:
            raise ValueError("caveat must be a non-empty string saying what the guarantee does not cover.")
        if caveat not in self._caveats:
            self._caveats.append(caveat)

    def record_nonprivate(self, reason: str) -> None:
        """Marks the run as NOT differentially private: epsilon is ``inf`` from now on, so the
        budget is dropped (``target_epsilon = None``): it can no longer be kept, only reported broken."""
        if not isinstance(reason, str) or not reason:
            raise ValueError("reason must be a non-empty string saying what broke privacy.")
        if reason not in self._nonprivate:
            self._nonprivate.append(reason)
        self._target_epsilon = None

    def absorb(self, other: PrivacyLedger) -> None:
        """Adds ``other``'s charges, non-private reasons and caveats to this ledger: a run resumed from a
        checkpoint keeps what its process recorded before the checkpoint's ledger replaced its own."""
        for entry in other.entries:
            self.charge(entry)
        for reason in other.nonprivate_reasons:
            self.record_nonprivate(reason)
        for caveat in other._caveats:
            self.record_caveat(caveat)

    def record_tuning(self, count: CandidateCount) -> None:
        """Marks the recorded entries as *one candidate* of a private tuning that ran a random number of
        candidates drawn from ``count`` and released the best (:mod:`sparta_tf.privacy.tuning`): epsilon
        is then that of ``RepeatAndSelectDpEvent(entries, mean, shape)``, which only the RDP accountant
        composes (the ledger switches to it). Once per ledger."""
        if self._tuning is not None:
            raise ValueError("this ledger already records a tuning; a tuning of tunings is not supported")
        self._tuning = count
        self.accountant = tuning.ACCOUNTANT

    @property
    def tuning(self) -> CandidateCount | None:
        """The distribution of the number of candidates when the ledger records a private tuning (else None)."""
        return self._tuning

    # ------------------------------------------------------------------ views

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        """The (merged) entries, oldest first."""
        return self._entries

    @property
    def steps(self) -> int:
        """Total number of mechanism runs recorded (all kinds)."""
        return sum(entry.count for entry in self._entries)

    @property
    def nonprivate_reasons(self) -> tuple[str, ...]:
        return tuple(self._nonprivate)

    @property
    def is_private(self) -> bool:
        """False once a non-private run was recorded (a reason, or ``sigma = 0``)."""
        return not self._nonprivate and all(e.noise_multiplier > 0 for e in self._entries)

    @property
    def covered_by_accountant(self) -> bool:
        """True iff batches were Poisson-sampled, as the accountant assumes."""
        return self.sampling == POISSON

    def as_dp_event(self) -> dp_accounting.DpEvent:
        """``ComposedDpEvent`` of one ``SelfComposedDpEvent`` per entry (+ ``NonPrivateDpEvent``s), inside
        ``RepeatAndSelectDpEvent`` when the ledger records a tuning."""
        event = _as_dp_event(self._entries, len(self._nonprivate))
        return event if self._tuning is None else tuning.tuning_event(event, self._tuning)

    # ------------------------------------------------------------------ epsilon

    def epsilon(self) -> float:
        """Epsilon spent so far at ``self.delta`` (cached until the next record)."""
        return self._epsilon_of(self._entries)

    def epsilon_if(self, planned: Iterable[PlannedRun]) -> float:
        """Epsilon after the recorded runs plus ``planned`` ones (nothing is recorded).

        ``planned`` holds :class:`LedgerEntry` objects or tuples
        ``(sigma, q, count[, kind[, phase]])``; they are merged exactly as
        :meth:`record` would, so ``epsilon_if(x)`` equals ``epsilon()`` after
        recording ``x`` (and that value is then served from the cache).
        """
        entries = self._entries
        for run in planned:
            entries = _appended(entries, _as_entry(run))
        return self._epsilon_of(entries)

    def fits_budget(self, planned: Iterable[PlannedRun] = ()) -> bool:
        """``epsilon_if(planned) <= target_epsilon`` (always True without a target)."""
        if self.target_epsilon is None:
            return True
        return self.epsilon_if(planned) <= self.target_epsilon * (1 + _BUDGET_SLACK)

    def _epsilon_of(self, entries: tuple[LedgerEntry, ...]) -> float:
        if self._nonprivate:
            return math.inf
        # memoised by accounting.epsilon_of_event (keyed on the event, delta and accountant)
        return _compute_epsilon(entries, self.delta, self.accountant, self._tuning)

    # ------------------------------------------------------------------ persistence

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict holding everything needed to recompute epsilon."""
        return {
            "version": LEDGER_FORMAT_VERSION,
            "delta": self.delta,
            "accountant": self.accountant,
            "target_epsilon": self.target_epsilon,
            "sampling": self.sampling,
            "entries": [entry.to_dict() for entry in self._entries],
            "nonprivate": list(self._nonprivate),
            "caveats": list(self._caveats),
        } | ({} if self._tuning is None else {"tuning": self._tuning.to_dict()}) | (
            {} if self.unit == "example" else {"unit": self.unit})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrivacyLedger:
        """Inverse of :meth:`to_json`."""
        version = data.get("version")
        if version != LEDGER_FORMAT_VERSION:
            raise ValueError(
                f"privacy ledger version {version!r} is not supported; expected {LEDGER_FORMAT_VERSION}."
            )
        ledger = cls(
            delta=data["delta"],
            accountant=data["accountant"],
            target_epsilon=data.get("target_epsilon"),
            sampling=data.get("sampling", POISSON),
            unit=data.get("unit", "example"),
        )
        for entry in data["entries"]:
            ledger._entries = _appended(ledger._entries, LedgerEntry.from_dict(entry))
        for reason in data.get("nonprivate", []):
            ledger.record_nonprivate(reason)
        for caveat in data.get("caveats", []):
            ledger.record_caveat(caveat)
        if "tuning" in data:
            ledger.record_tuning(CandidateCount.from_dict(data["tuning"]))
        return ledger

    def save(self, path: str | os.PathLike) -> None:
        """Writes :meth:`to_json` to ``path`` atomically (:func:`sparta_tf.atomic_files.write_atomic`)."""
        write_atomic(path, json.dumps(self.to_json(), indent=1), prefix=".ledger-", suffix=".tmp")

    @classmethod
    def load(cls, path: str | os.PathLike) -> PrivacyLedger:
        """Reads a ledger written by :meth:`save`."""
        with open(path) as f:
            return cls.from_json(json.load(f))

    # ------------------------------------------------------------------ report

    def report(self) -> str:
        """A human-readable multi-line privacy report."""
        lines = ["Privacy report", f"  epsilon spent : {self._epsilon_line()}"]
        lines += [
            f"  delta         : {self.delta:g}",
            f"  accountant    : {self.accountant} (dp_accounting, add/remove-one neighbours)",
            f"  unit          : {UNIT_LINES[self.unit]}",
            f"  sampling      : {self.sampling}",
            f"  mechanism runs: {self.steps}" + ("" if self._tuning is None else " (one candidate)"),
        ]
        if self._tuning is not None:
            lines.insert(2, f"  tuning        : the best of a {self._tuning.describe()} "
                            "(RepeatAndSelectDpEvent); each candidate ran the mechanisms below")
        lines += [f"    {row}" for row in _summary_rows(self._entries)]
        lines += [f"  NOT differentially private: {reason}" for reason in self._nonprivate]
        if self.is_private:
            lines.append(f"  covers        : {COVERAGE if self._tuning is None else TUNING_COVERAGE}")
        lines += [f"  WARNING: {caveat}" for caveat in self.caveats()]
        return "\n".join(lines)

    def caveats(self) -> list[str]:
        """What keeps the epsilon above from being a proven guarantee for this run (empty: nothing)."""
        own = [] if self.covered_by_accountant else [sampling_caveat(self.sampling)]
        return own + list(self._caveats)

    def _epsilon_line(self) -> str:
        epsilon = self.epsilon()
        if math.isinf(epsilon):
            return "inf (NOT differentially private)"
        if self.target_epsilon is None:
            return f"{epsilon:.4f}"
        used = 100.0 * epsilon / self.target_epsilon
        return f"{epsilon:.4f} of target {self.target_epsilon:g} ({used:.1f}% used)"

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(delta={self.delta:g}, accountant={self.accountant!r}, "
            f"target_epsilon={self.target_epsilon}, sampling={self.sampling!r}, "
            f"steps={self.steps}, entries={len(self._entries)})"
        )


UNITS = ("example", "user")
"""What a neighbouring data set adds or removes: one example, or all of one user's examples."""


def check_unit(unit: str) -> str:
    """``unit`` if it is one of :data:`UNITS`, else a ValueError naming the fix."""
    if unit not in UNITS:
        raise ValueError(f"unit={unit!r} must be 'example' (each example is protected) or 'user' (all of one "
                         "person's examples together; pass users= to fit)")
    return unit


UNIT_LINES = {
    "example": "one example (a person with k examples is covered only by group privacy, about k epsilon)",
    "user": "one user (add or remove all of one person's examples)",
}


COVERAGE = (
    "the weights after every step (checkpoints, mask, export), for the private training split, while "
    "the run's seed stays secret (whoever knows it can recompute the noise; checkpoints hold it); "
    "not the logged metrics (training loss/accuracy are noiseless means over private batches; "
    "validation/test metrics come from examples never trained on): keep the run's logs and checkpoints private"
)


TUNING_COVERAGE = (
    "the released candidate's weights (mask, export), its hyperparameters and its noisy validation score, for "
    "the private training and validation splits, while the tuning's seeds stay secret; not the number of "
    "candidates, the other candidates, or any candidate's logs and checkpoints: keep the tuning directory private"
)


def _as_dp_event(entries: Sequence[LedgerEntry], nonprivate: int = 0) -> dp_accounting.DpEvent:
    events = [entry.as_dp_event() for entry in entries]
    events += [dp_accounting.NonPrivateDpEvent()] * nonprivate
    return dp_accounting.ComposedDpEvent(events)


def _compute_epsilon(entries: Sequence[LedgerEntry], delta: float, accountant: str,
                     repeated: CandidateCount | None = None) -> float:
    """Epsilon of the entries' composition, or (``repeated``) of the tuning that repeats it."""
    if not entries and repeated is None:
        return 0.0
    if any(entry.noise_multiplier == 0 for entry in entries):
        return math.inf
    event = _as_dp_event(entries)
    return accounting.epsilon_of_event(event if repeated is None else tuning.tuning_event(event, repeated), delta,
                                       accountant)


def _summary_rows(entries: Sequence[LedgerEntry]) -> list[str]:
    """One row per distinct (phase, kind, sigma, q), in order of first appearance."""
    counts: dict[tuple, int] = {}
    for entry in entries:
        key = (entry.phase, entry.kind, entry.noise_multiplier, entry.sample_rate, entry.bands)
        counts[key] = counts.get(key, 0) + entry.count
    return [
        f"phase {phase or '-'}: {count} x {kind}, noise_multiplier={sigma:.6g}, sample_rate={q:.6g}"
        + ("" if bands == 1 else f" per group, bands={bands} (cyclic Poisson; charged as {reduced_steps(count, bands)})")
        for (phase, kind, sigma, q, bands), count in counts.items()
    ]
