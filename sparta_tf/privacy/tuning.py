"""Private hyperparameter tuning: the privacy of "run a random number of candidates, release the best".

The procedure (Papernot & Steinke, ICLR 2022, "Hyperparameter Tuning with Renyi Differential Privacy")::

    K ~ D(mean, shape)                         # secret: drawn from the "tuning_count" stream
    for k = 1 .. K:
        h_k ~ the search space                 # independent draws ("tuning_candidates" stream)
        (model_k, s_k) = Q(data; h_k)          # a private training, then a noisy validation score
    release (model_j, h_j, s_j), j = argmax_k s_k   # and nothing else: not K, not the other candidates

``Q`` is one DP mechanism (each candidate's training and score, the same events for every ``h``); the
whole procedure is dp-accounting's ``RepeatAndSelectDpEvent(Q, mean, shape)``, which only the RDP
accountant composes. ``D(mean, shape)`` is

* ``shape = inf``: Poisson(``mean``) (``K = 0`` is possible: then nothing is released);
* ``shape = 1``: geometric on ``{1, 2, ...}``, ``P[K = k] = gamma (1 - gamma)^(k-1)``, ``gamma = 1/mean``;
* ``shape = 0``: logarithmic, ``P[K = k] = (1 - gamma)^k / (k log(1/gamma))``;
* ``0 < shape < inf``: the truncated negative binomial ``NB(shape, gamma)`` conditioned on ``K >= 1``,
  ``P[K = k] ∝ C(k + shape - 1, k) (1 - gamma)^k``, of mean ``shape (1 - gamma) / (gamma (1 - gamma^shape))``.

The smaller the shape the cheaper the repetition (its cost grows like ``(1 + shape)`` times a per-run
term plus ``log(mean)``), and the heavier the tail of ``K``.

The score is part of ``Q``: a count over the validation split (examples the candidate never trained on,
each counted at most once, so add/remove of one example moves it by at most 1) plus Gaussian noise of std
``score_noise`` examples, the ledger entry ``M_{1, score_noise}`` (``kind="tuning_score"``). The
guarantee then covers the training and the validation splits alike.

The plan calibrates a candidate's noise multipliers so that :class:`Repetition` of its events (the
whole procedure) meets ``(epsilon, delta)`` (each method keeps its own split of the budget);
:func:`per_run_signal` is the test behind refusing a per-run noise that leaves nothing to learn.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import dp_accounting
import numpy as np

from sparta_tf.choices import CANDIDATE_DISTRIBUTIONS, candidate_mean, candidate_shape
from sparta_tf.privacy import accounting

ACCOUNTANT = "rdp"
"""The only accountant of ``RepeatAndSelectDpEvent`` in dp-accounting (its PLD accountant refuses it)."""

SCORE_KIND = "tuning_score"
"""The ledger ``kind`` of a candidate's noisy validation score."""

MIN_SIGNAL = 1.0
"""Refuse a per-run noise with :func:`per_run_signal` below this (see there)."""

_GAMMA_BISECTIONS = 200


@dataclasses.dataclass(frozen=True)
class CandidateCount:
    """The distribution ``D(mean, shape)`` of the number of candidate runs ``K`` (module doc)."""

    mean: float
    shape: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", candidate_shape(self.shape))
        object.__setattr__(self, "mean", candidate_mean(self.mean, self.shape))

    @property
    def name(self) -> str:
        for name, shape in CANDIDATE_DISTRIBUTIONS.items():
            if self.shape == shape:
                return name
        return "truncated negative binomial"

    @property
    def gamma(self) -> float:
        """The success probability ``gamma`` with ``E[K] = mean`` (Poisson: none). Found by bisection to the
        last bit, from above: the distribution sampled has mean ``<= mean`` and ``gamma`` at least the one
        dp-accounting's analysis uses (a conservative lower end), so the analysis bounds what is sampled."""
        if self.shape == math.inf:
            raise ValueError("the Poisson distribution has no gamma")
        if self.shape == 1.0:
            return 1.0 / self.mean
        low, high = 0.0, 1.0
        for _ in range(_GAMMA_BISECTIONS):
            middle = 0.5 * (low + high)
            if middle in (low, high):
                break
            low, high = (low, middle) if _tnb_mean(middle, self.shape) <= self.mean else (middle, high)
        return high

    def pmf(self, k: int | np.ndarray) -> np.ndarray:
        """``P[K = k]``."""
        from scipy import stats

        k = np.asarray(k)
        if self.shape == math.inf:
            return stats.poisson.pmf(k, self.mean)
        gamma = self.gamma
        if self.shape == 0.0:
            return np.where(k >= 1, stats.logser.pmf(np.maximum(k, 1), 1.0 - gamma), 0.0)
        if gamma >= 1.0:  # mean 1: one run (see :meth:`sample`)
            return np.where(k == 1, 1.0, 0.0)
        at_least_one = -math.expm1(self.shape * math.log(gamma))  # 1 - gamma^shape = P[NB >= 1]
        return np.where(k >= 1, stats.nbinom.pmf(k, self.shape, gamma) / at_least_one, 0.0)

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of ``K`` from ``rng`` (pass the secret ``tuning_count`` stream's generator)."""
        if self.shape == math.inf:
            return int(rng.poisson(self.mean))
        gamma = self.gamma
        if self.shape == 0.0:
            return int(rng.logseries(1.0 - gamma))
        if gamma >= 1.0:  # mean 1 (geometric only): one run, the limit of NB conditioned on >= 1 as gamma -> 1
            return 1
        while True:  # NB(shape, gamma) conditioned on >= 1 (rejection: accepts with probability 1 - gamma^shape)
            k = int(rng.negative_binomial(self.shape, gamma))
            if k >= 1:
                return k

    def describe(self) -> str:
        shape = "" if self.name != "truncated negative binomial" else f", shape {self.shape:g}"
        none = f"; P[K = 0] = {math.exp(-self.mean):.2g}: nothing released" if self.shape == math.inf else ""
        return f"{self.name} number of candidate runs, mean {self.mean:g}{shape}{none}"

    def to_dict(self) -> dict:
        return {"mean": self.mean, "shape": "inf" if self.shape == math.inf else self.shape}

    @classmethod
    def from_dict(cls, data: dict) -> CandidateCount:
        shape = data["shape"]
        return cls(float(data["mean"]), math.inf if shape == "inf" else float(shape))


def _tnb_mean(gamma: float, shape: float) -> float:
    """``E[K]`` of the truncated negative binomial (``shape = 0``: logarithmic), ``0 < gamma < 1``."""
    if shape == 0.0:
        return (1.0 - gamma) / (gamma * -math.log(gamma))
    return shape * (1.0 - gamma) / (gamma * -math.expm1(shape * math.log(gamma)))


def tuning_event(per_run: dp_accounting.DpEvent, count: CandidateCount) -> dp_accounting.DpEvent:
    """``RepeatAndSelectDpEvent(per_run, mean, shape)``: the whole tuning as dp-accounting sees it."""
    return dp_accounting.dp_event.RepeatAndSelectDpEvent(per_run, count.mean, count.shape)


def tuning_epsilon(per_run: dp_accounting.DpEvent, count: CandidateCount, delta: float) -> float:
    """``epsilon(delta)`` of :func:`tuning_event` under dp-accounting's RDP accountant."""
    return accounting.epsilon_of_event(tuning_event(per_run, count), delta, ACCOUNTANT)


def score_event(score_noise: float) -> dp_accounting.DpEvent:
    """One noisy validation score: a Gaussian of std ``score_noise`` on a count of sensitivity 1 (the ledger
    entry ``M_{1, score_noise}``, ``kind`` :data:`SCORE_KIND`)."""
    if not score_noise > 0:
        raise ValueError(f"score_noise={score_noise!r} must be > 0 (examples): a noiseless score is not private")
    return dp_accounting.GaussianDpEvent(score_noise)


def epsilon_of_tuning(entries: Sequence, repetition: "Repetition", delta: float) -> float:
    """``epsilon(delta)`` of the tuning whose candidates each run ``entries`` (a ledger's) and a score."""
    return tuning_epsilon(per_run_event(entries, repetition.score_noise), repetition.count, delta)


def per_run_event(entries: Sequence, score_noise: float) -> dp_accounting.DpEvent:
    """One candidate: its training's ledger entries (``as_dp_event()`` each), then its score."""
    events = [entry.as_dp_event() for entry in entries if entry.count]
    return dp_accounting.ComposedDpEvent(events + [score_event(score_noise)])


@dataclasses.dataclass(frozen=True)
class Repetition:
    """The tuning around one candidate: ``RepeatAndSelectDpEvent(candidate o score, mean, shape)``. Called
    on a candidate's training event it returns the whole tuning's event; the plan calibrates its noise
    multipliers through it (:func:`sparta_tf.privacy.plan.make_privacy_plan`'s ``tuning``), so that the
    tuning, not one run, meets the target. Hashable: calibrations are memoised on it."""

    count: CandidateCount
    score_noise: float

    def __post_init__(self) -> None:
        score_event(self.score_noise)  # validates

    def __call__(self, training: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
        return tuning_event(dp_accounting.ComposedDpEvent([training, score_event(self.score_noise)]), self.count)

    def floor(self, delta: float) -> float:
        """The tuning's epsilon when its candidates' training costs nothing (infinite noise): what repeating
        and scoring cost by themselves; no target at or below it can be met."""
        return accounting.epsilon_of_event(self(dp_accounting.NoOpDpEvent()), delta, ACCOUNTANT)

    def to_dict(self) -> dict:
        return {"count": self.count.to_dict(), "score_noise": self.score_noise}


class TuningBudgetError(accounting.PrivacyBudgetExceededError):
    """No per-run noise makes the tuning meet the target, or the one that does leaves nothing to learn."""


def per_run_signal(noise_multiplier: float, expected_batch_size: float, steps: int) -> float:
    """``sqrt(T) b / sigma``: over ``T`` steps of mean clipped gradients (norm ``<= C`` each, expected batch
    ``b``), the largest norm their sum can have (``T C``) over the noise std of one coordinate of that sum
    (``sqrt(T) sigma C / b``). Below :data:`MIN_SIGNAL` = 1, even ``T`` steps all pushing one way with the
    largest clipped norm move the weights less than one coordinate's noise: whatever the model and data,
    the run cannot learn, and tuning with it only spends the budget."""
    if noise_multiplier <= 0:
        return math.inf
    return math.sqrt(steps) * expected_batch_size / noise_multiplier
