"""The steps of a private tuning that the library (:func:`sparta_tf.tune_privately`) and ``sparta-tune``
share: the secret draws, each candidate's noisy score, the selection and the released ledger.

The privacy analysis is :mod:`sparta_tf.privacy.tuning`'s. What a tuning keeps to itself (the tuning
directory, or nothing in memory): the seed, the number of candidates ``K``, every candidate's values,
run, logs and score. What it releases: the best candidate's model, its values, its noisy score, and a
ledger whose epsilon is the whole procedure's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from sparta_tf import random_streams
from sparta_tf.privacy import tuning as tuning_privacy
from sparta_tf.privacy.ledger import LedgerEntry, PrivacyLedger
from sparta_tf.privacy.tuning import CandidateCount, Repetition
from sparta_tf.tuning import space as search_space

SEED_CAVEAT = ("the tuning's seed was given (tuning.seed / tuning_seed): the number of candidates, their values, "
               "their noise and their scores' noise follow from it, so the guarantee holds only while that "
               "seed stays as secret as the data; leave it unset (the default) for a secret seed")

UNPLANNED = "unplanned"
"""A released entry's kind and phase for a mechanism the plan does not run."""


class Tally:
    """What the release needs from the candidates, in their order: each one's noisy score (None: diverged)
    and ledger entries (the plan's first: the floor when none finished), caveats and reasons it is not
    private; ``unit``: what the plan's neighbouring datasets differ by, which every candidate's ledger
    must share."""

    def __init__(self, planned: Sequence[LedgerEntry], unit: str = "example"):
        self.unit = unit
        self.scores: list[float | None] = []
        self.entries: list[list[LedgerEntry]] = [list(planned)]
        self.caveats: list[str] = []
        self.nonprivate: list[str] = []

    def add(self, score: float | None, ledger: PrivacyLedger | None = None) -> None:
        self.scores.append(score)
        if ledger is not None:
            if ledger.unit != self.unit:
                raise ValueError(f"a candidate's ledger protects one {ledger.unit} but the tuning's plan one "
                                 f"{self.unit}; every candidate must train at the plan's unit")
            self.entries.append(list(ledger.entries))
            for caveat in ledger.caveats():
                self.record_caveat(caveat)
            self.nonprivate += [r for r in ledger.nonprivate_reasons if r not in self.nonprivate]

    def record_caveat(self, caveat: str) -> None:
        """A caveat of the release (once)."""
        if caveat not in self.caveats:
            self.caveats.append(caveat)

    @property
    def best(self) -> int | None:
        """:func:`best_index` of the scores so far."""
        return best_index(self.scores)

    def released_ledger(self, draws: Draws, *, delta: float, target_epsilon: float,
                        sampling: str = "poisson") -> PrivacyLedger:
        """:func:`released_ledger` of the candidates so far (with :data:`SEED_CAVEAT` for a given seed)."""
        caveats = self.caveats + ([SEED_CAVEAT] if draws.seed_given else [])
        return released_ledger(self.entries, count=draws.count, delta=delta, target_epsilon=target_epsilon,
                               sampling=sampling, caveats=caveats, nonprivate=self.nonprivate, unit=self.unit)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate run: its drawn ``values`` and the seed of its DP training (secret)."""

    values: dict
    run_seed: int


@dataclasses.dataclass(frozen=True)
class Draws:
    """Everything random about a tuning that does not touch the data, drawn once before the first
    candidate runs and kept (a resumed tuning never draws again): ``K ~ count`` from the
    ``tuning_count`` stream, each candidate's values from ``tuning_candidates``, its run seed from
    ``tuning_runs``; all from the tuning's own seed, never from a run seed in a config. The winner's values
    are released, so with a secret tuning seed they come from a second seed drawn apart from it (and not
    kept: the values are), or they would let anyone test guesses of the seed behind every run seed."""

    seed: int
    seed_given: bool
    count: CandidateCount
    candidates: tuple[Candidate, ...]

    @classmethod
    def draw(cls, count: CandidateCount, space: Mapping, seed: int | None = None) -> Draws:
        given = seed is not None
        seed = random_streams.resolve_seed(seed)
        k = count.sample(random_streams.numpy_rng(seed, "tuning_count"))
        values_rng = random_streams.numpy_rng(seed if given else random_streams.new_seed(), "tuning_candidates")
        run_seeds = random_streams.numpy_rng(seed, "tuning_runs").integers(0, random_streams.MAX_SEED, size=k)
        candidates = tuple(Candidate(search_space.draw(space, values_rng), int(run_seed)) for run_seed in run_seeds)
        return cls(seed, given, count, candidates)

    def public_seed(self, index: int) -> int:
        """Candidate ``index``'s public seed (its random mask's; :mod:`sparta_tf.random_streams`): its run
        seed when the tuning's seed was given (one seed reproduces the tuning), else a fresh seed drawn
        apart from every secret one, which the released winner's mask then tells nothing of (a resumed
        candidate keeps its checkpoint's)."""
        return self.candidates[index].run_seed if self.seed_given else random_streams.new_seed()

    def score_noise(self, index: int, score_noise: float) -> float:
        """The Gaussian noise (std ``score_noise`` examples) of candidate ``index``'s score: the
        ``tuning_score_noise`` stream's ``index``-th draw, so scoring a candidate again after a crash
        releases the same value (no new release)."""
        rng = random_streams.numpy_rng(self.seed, "tuning_score_noise")
        return float(rng.normal(0.0, score_noise, size=len(self.candidates))[index])

    def to_json(self) -> dict:
        return {"seed": self.seed, "seed_given": self.seed_given, "count": self.count.to_dict(),
                "candidates": [dataclasses.asdict(c) for c in self.candidates]}

    @classmethod
    def from_json(cls, data: dict) -> Draws:
        return cls(int(data["seed"]), bool(data["seed_given"]), CandidateCount.from_dict(data["count"]),
                   tuple(Candidate(dict(c["values"]), int(c["run_seed"])) for c in data["candidates"]))


def default_score_noise(validation_size: int) -> float:
    """``sqrt(n_val) / 2`` examples: the largest standard deviation the count of correct predictions on
    ``n_val`` examples has by sampling alone (a binomial at accuracy 1/2), so the noise at most doubles the
    variance of the score a non-private tuning would read."""
    return math.sqrt(validation_size) / 2.0


def expected_validation_units(training_units: int, val_fraction: float) -> int:
    """``E[n_val] = round(n_train f / (1 - f))``: the validation split's expected size when it holds out
    ``f = val_fraction`` of the training data, from the training split's size ``n_train`` (examples, or users
    at user level; public, as the ledger's ``q`` releases it). The actual ``n_val`` follows from which
    examples the split held out; the default score noise and the score's denominator use this instead,
    so that a release does not reveal it."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in (0, 1) for a validation split")
    return max(1, round(training_units * val_fraction / (1.0 - val_fraction)))


VALIDATION_SIZE_CAVEAT = ("the noisy validation score is divided by the validation split's size, and the default score "
                          "noise follows from it, so the release reveals that size; pass public_validation_size to "
                          "tune_privately (a size fixed without reading the private data), or start a sparta-tune "
                          "tuning again (one started by an older sparta-tf)")


def public_denominator(public_validation_size: int | None, validation_size: int) -> int:
    """What the noisy count is divided by: ``public_validation_size`` (checked: an int >= 1), else the split's
    own size ``n_val`` (:data:`VALIDATION_SIZE_CAVEAT`)."""
    if public_validation_size is None:
        return validation_size
    if isinstance(public_validation_size, bool) or not isinstance(public_validation_size, int) \
            or public_validation_size < 1:
        raise ValueError(f"public_validation_size={public_validation_size!r} must be an integer >= 1 (a validation "
                         "size fixed without reading the private data, e.g. your split's expected size)")
    return public_validation_size


def check_validation_size(validation_size: int) -> None:
    if validation_size < 1:
        raise ValueError("the tuning scores candidates on a validation split and there is none: give validation "
                         "data (data.val_fraction > 0 in a config)")


def count_correct(model, x, y, batch_size: int = 256, users=None) -> float:
    """How many of the examples ``x`` the model labels ``y`` (argmax of its outputs): each example adds
    0 or 1, so adding or removing one example moves the count by at most 1. With ``users`` (each example's
    user id; user-level DP) the count is over users: each user adds the share of its examples labelled
    right, in ``[0, 1]``, so adding or removing one user moves it by at most 1."""
    predictions = model.predict(x, batch_size=batch_size, verbose=0)
    right = (np.argmax(predictions, axis=-1) == np.asarray(y).reshape(-1)).astype(np.float64)
    if users is None:
        return int(np.sum(right))
    _, user, sizes = np.unique(np.asarray(users), return_inverse=True, return_counts=True)
    return float(np.sum(np.bincount(user, weights=right) / sizes))


def validation_units(y_val, users=None) -> int:
    """``n_val`` of the score: the validation examples, or with ``users`` the validation users."""
    return len(y_val) if users is None else len(np.unique(np.asarray(users)))


def noisy_score(correct: int, noise: float, denominator: float) -> float:
    """The released score: ``(correct + noise) / denominator``, a noisy validation accuracy (``denominator``:
    ``n_val``, or a public stand-in for it, :func:`expected_validation_units`)."""
    return (correct + noise) / denominator


def score_candidate(dp, x_val, y_val, draws: Draws, index: int, score_noise: float, users=None,
                    denominator: float | None = None) -> float:
    """Candidate ``index``'s noisy validation accuracy (:func:`count_correct`, the noise of
    :meth:`Draws.score_noise`), charged to its ledger as :func:`score_entry`. The candidate's own budget
    covered its training; the tuning's ledger covers the score, so the candidate's budget is dropped.
    ``users``: the validation examples' user ids at user level (the accuracy is then the users' mean).
    ``denominator``: what the count is divided by, the same for every candidate (None: ``n_val``)."""
    correct = count_correct(dp.model, x_val, y_val, users=users)
    dp.ledger.target_epsilon = None
    dp.ledger.charge(score_entry(score_noise))
    return noisy_score(correct, draws.score_noise(index, score_noise),
                       validation_units(y_val, users) if denominator is None else denominator)


def best_index(scores: Sequence[float | None]) -> int | None:
    """The candidate with the highest noisy score (the first among equals; None scores, diverged runs,
    rank last); None when there is no candidate with a score."""
    ranked = [(score, -index) for index, score in enumerate(scores) if score is not None and math.isfinite(score)]
    return -max(ranked)[1] if ranked else None


def check_one_mechanism(reference, plan_of, candidates, where: str) -> None:
    """A one-line ValueError (naming the space as ``where``) unless every candidate's plan (``plan_of(values)``
    for each ``values`` of ``candidates``) runs ``reference``'s mechanisms: the analysis repeats one."""
    signature = plan_signature(reference.events())
    for values in candidates:
        if plan_signature(plan_of(values).events()) != signature:
            raise ValueError(f"{where}: a candidate with {values} runs other privacy mechanisms than the others (its noise "
                             "or steps differ); every candidate must run the same mechanism: keep that key out of "
                             "the space")


def plan_signature(entries: Sequence[LedgerEntry]) -> dict:
    """What the analysis sees of a run: how many times each mechanism ``(sigma, q)`` ran (a banded
    entry's :attr:`~sparta_tf.privacy.ledger.LedgerEntry.compositions`, summed per entry: never fewer
    than the steps of all its entries charged as one)."""
    signature: dict = {}
    for entry in entries:
        key = (entry.noise_multiplier, entry.sample_rate)
        signature[key] = signature.get(key, 0) + entry.compositions
    return signature


def score_entry(score_noise: float) -> LedgerEntry:
    """The ledger entry of one noisy validation score: ``M_{1, score_noise}``
    (:func:`~sparta_tf.privacy.tuning.score_event`)."""
    tuning_privacy.score_event(score_noise)  # validates
    return LedgerEntry(score_noise, 1.0, 1, tuning_privacy.SCORE_KIND, "tuning")


def dominating_entries(ledgers: Sequence[Sequence[LedgerEntry]]) -> list[LedgerEntry]:
    """Entries whose composition dominates every candidate's (for ``RepeatAndSelectDpEvent``'s one
    repeated event): per distinct mechanism ``(sigma, q)`` the largest count any candidate ran. RDP adds
    over a composition and every term is >= 0, so more runs of a mechanism never cost less; a candidate
    killed and resumed, which repeats steps (all charged), is covered this way.

    The labels (kind, phase) come from the first ledger, the plan's, only: a candidate's own labels
    (its phases' names where the space changes their lengths, an ``interrupted`` charge) would tell
    which candidates ran besides the winner, which the analysis does not cover."""
    counts: dict[tuple, int] = {}
    for entries in ledgers:
        for key, count in plan_signature(entries).items():
            counts[key] = max(counts.get(key, 0), count)
    labels: dict[tuple, tuple[str, list]] = {}
    for entry in ledgers[0] if ledgers else ():
        _, phases = labels.setdefault((entry.noise_multiplier, entry.sample_rate), (entry.kind, []))
        if entry.phase not in phases:
            phases.append(entry.phase)
    return [LedgerEntry(sigma, q, count, *_released_labels(labels.get((sigma, q))))
            for (sigma, q), count in counts.items()]


def _released_labels(planned: tuple[str, list] | None) -> tuple[str, str]:
    """``(kind, phase)`` of a released entry from the plan's labels of its mechanism (None: the plan has
    none, which :func:`check_one_mechanism` rules out for a candidate's training)."""
    if planned is None:
        return UNPLANNED, UNPLANNED
    kind, phases = planned
    return kind, "+".join(p or "-" for p in phases)


def released_ledger(candidate_entries: Sequence[Sequence[LedgerEntry]], *, count: CandidateCount, delta: float,
                    target_epsilon: float, sampling: str = "poisson", caveats: Sequence[str] = (),
                    nonprivate: Sequence[str] = (), unit: str = "example") -> PrivacyLedger:
    """The ledger of the released model: ``RepeatAndSelectDpEvent`` of the entries that dominate every
    candidate's (:func:`dominating_entries`; pass the planned per-run entries
    among them, so that a tuning with no finished candidate is still charged its plan), protecting one
    ``unit`` (the candidates')."""
    ledger = PrivacyLedger(delta, accountant=tuning_privacy.ACCOUNTANT, target_epsilon=target_epsilon,
                           sampling=sampling, unit=unit)
    for entry in dominating_entries(candidate_entries):
        ledger.charge(entry)
    for reason in nonprivate:
        ledger.record_nonprivate(reason)
    for caveat in caveats:
        ledger.record_caveat(caveat)
    ledger.record_tuning(count)
    return ledger


def planned_entries(plan) -> list[LedgerEntry]:
    """One candidate's planned entries (a tuning candidate's :class:`~sparta_tf.privacy.plan.PrivacyPlan`):
    its training's, then its score's."""
    return list(plan.events()) + [score_entry(plan.tuning.score_noise)]


def tuned_plan(plan_with, repetition: Repetition, target_epsilon: float, delta: float):
    """``plan_with(repetition)``, a candidate's plan calibrated for the tuning; a target at or below what
    repeating and scoring cost by themselves (:meth:`Repetition.floor`) refused first, in one line."""
    floor = repetition.floor(delta)
    if floor >= target_epsilon:
        raise tuning_privacy.TuningBudgetError(
            f"no per-run noise meets target_epsilon={target_epsilon:g}: a {repetition.count.describe()} and its "
            f"noisy scores spend epsilon {floor:.3g} by themselves; raise the target, lower the mean number of "
            "candidates or the shape, or give a larger score_noise")
    return plan_with(repetition)


def check_signal(plan) -> float:
    """Refuses (one line) a per-run noise that leaves nothing to learn
    (:func:`~sparta_tf.privacy.tuning.per_run_signal` below :data:`~sparta_tf.privacy.tuning.MIN_SIGNAL`);
    returns the signal."""
    signal = tuning_privacy.per_run_signal(plan.noise_multiplier, plan.sample_rate * plan.n, plan.steps)
    if signal < tuning_privacy.MIN_SIGNAL:
        raise tuning_privacy.TuningBudgetError(
            f"each candidate would train with noise multiplier {plan.noise_multiplier:.4g}: over its {plan.steps} "
            f"steps even the largest clipped gradients sum to less than one coordinate's noise (sqrt(T) b / sigma "
            f"= {signal:.3g} < {tuning_privacy.MIN_SIGNAL:g}), so no candidate can learn; raise the target epsilon, "
            "lower the mean number of candidates, or train longer / with larger batches")
    return signal


def describe_tuning(plan, space: Mapping | list, validation_size: int, untuned=None) -> str:
    """The dry run's lines on the tuning: the distribution, the space, the score, each candidate's and the
    whole procedure's epsilon, and (``untuned``: the plan of one run at the whole target) the price."""
    repetition = plan.tuning
    signal = tuning_privacy.per_run_signal(plan.noise_multiplier, plan.sample_rate * plan.n, plan.steps)
    lines = [
        f"private tuning: release the best of a {repetition.count.describe()} (RepeatAndSelectDpEvent, RDP)",
        f"search space (each candidate draws independently): {search_space.describe(space)}",
        f"score: correct predictions on the n_val = {validation_size} validation "
        f"{'examples' if plan.unit == 'example' else 'users (each its share of examples right)'} + N(0, "
        f"{repetition.score_noise:.3g}^2) (std {repetition.score_noise / validation_size:.2%} of accuracy)",
        f"each candidate: epsilon {plan.epsilon:.4g} (rdp) for its training, noise multiplier "
        f"{plan.noise_multiplier:.4g}; signal sqrt(T) b / sigma = {signal:.4g} (refused below "
        f"{tuning_privacy.MIN_SIGNAL:g})",
        f"whole tuning: epsilon {plan.tuned_epsilon:.4g} of target {plan.target_epsilon:g} (delta {plan.delta:g})",
    ]
    if untuned is not None:
        untuned_signal = tuning_privacy.per_run_signal(untuned.noise_multiplier, untuned.sample_rate * untuned.n,
                                                       untuned.steps)
        lines.append(f"price of tuning: one untuned run at epsilon {plan.target_epsilon:g} would have noise "
                     f"multiplier {untuned.noise_multiplier:.4g} ({untuned.accountant}), signal {untuned_signal:.4g}: "
                     f"each candidate trains with {plan.noise_multiplier / untuned.noise_multiplier:.2f}x its noise")
    return "\n".join(lines)
