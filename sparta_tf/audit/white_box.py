"""The white-box audit: gradient canaries in the DP step, scored from every step's release.

With :class:`~sparta_tf.audit.gradient_canaries.GradientCanaries` in a run, the auditor reads
``x_t,j``, the released noisy sum on canary ``j``'s coordinate at each gradient step ``t``. On that
coordinate the data contribute nothing, so under the claimed mechanism::

    x_t,j = C B_t,j + e_t,j       B_t,j ~ Bernoulli(q_t) if canary j is included, else 0

with ``e_t,j`` the step's noise: ``N(0, sigma^2 C^2)`` independent over steps (DP-SGD), or the
banded correlated noise of BandMF. The scores (higher = looks included):

* ``steps`` (independent noise): the log-likelihood ratio of "included" against "left out",
  summed over the steps, each step a Poisson mixture::

      s_j = sum_t log(1 - q + q exp((C x_t,j - C^2 / 2) / (sigma C)^2))

  the most powerful test of one canary's presence given its observations (Neyman-Pearson), and
  what the ledger's analysis of the subsampled Gaussian bounds;
* ``prefix_sum`` (correlated noise): ``s_j = sum_t x_t,j``, the canary's total in the iterates'
  prefix sum, where BandMF's noise partly cancels (its variance is that of the prefix sum's noise,
  not of ``T`` independent draws);
* ``final_model``: ``s_j = -(theta_T - theta_0)[c_j]``, the canary coordinate's total descent in the
  last weights only (the black-box auditor's view of the same canaries; with plain SGD it is the
  prefix sum scaled by the learning rates).

Any score gives a valid bound (:func:`~sparta_tf.audit.one_run.audit_scores`); a better one only
gives a larger one. The claim is contradicted when the bound exceeds it.

How far the bound can go. The one-run bound treats each canary as randomised response; a Gaussian
mechanism's guesses are less sure than randomised response's at the same epsilon, and its ``2 m
delta`` term limits the number of canaries, so on an exact Gaussian mechanism it reaches about a
quarter of the claim (measured: 0.19 to 1.99 at epsilon 1 to 8, docs/audit.md). A mechanism whose noise or sampling rate
is off by a factor of two therefore stays under its claim. The white box sees more than the bound
uses, so the audit also checks the mechanism's parameters against the ledger
(:func:`mechanism_checks`): on the excluded canaries' coordinates the observations are the noise
alone, whose standard deviation must be ``sigma C`` (with correlated noise, after whitening by the
known factor ``C``: ``z_t = sum_k C_tk x_k / (sigma C)`` must be standard normal); on the included
canaries' coordinates their mean is ``q C`` (the participation rate). ``sigma`` and ``q`` are what the
ledger charged for the observed steps, not what the mechanism object says
(:func:`~sparta_tf.audit.white_box_run.white_box_report`). Each gets an interval; a claim outside it is
reported as a mechanism that does not match its ledger.

One verdict, one level. The audit reports a contradiction when a bound exceeds the claim or a check
fails: a union of tests. Each holds at its own level, split from the verdict's ``alpha = 1 -
confidence`` (Bonferroni, :func:`verdict_levels`): each of the two checks at ``alpha_c = alpha *
CHECK_SHARE`` (99.9% intervals at a 95% verdict), each of the ``b`` bounds at ``alpha_b = (alpha - 2
alpha_c) / b`` (``b = 2``: the step or prefix-sum score and the final model's; 3 with the black-box
bound of data canaries in the same run). ``b alpha_b + 2 alpha_c = alpha``, so an exact mechanism is
reported as contradicting or mismatching its claim with probability at most ``alpha``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from scipy import stats

from sparta_tf.audit.one_run import OneRunBound, audit_scores, ceiling


def step_scores(observations: np.ndarray, sample_rate: float, noise_std: float, clip_norm: float) -> np.ndarray:
    """``steps`` scores (module doc) of ``observations`` ``[T, m]``; ``noise_std = sigma C``."""
    x = np.asarray(observations, np.float64)
    exponent = (clip_norm * x - 0.5 * clip_norm**2) / noise_std**2
    per_step = np.logaddexp(np.log1p(-sample_rate), np.log(sample_rate) + exponent)
    return np.nansum(per_step, axis=0)  # NaN: a step that did not train the canary's coordinate


def prefix_sum_scores(observations: np.ndarray) -> np.ndarray:
    """``prefix_sum`` scores: each canary's total over the observed steps."""
    return np.nansum(np.asarray(observations, np.float64), axis=0)


def final_model_scores(initial: np.ndarray, final: np.ndarray) -> np.ndarray:
    """``final_model`` scores: minus each canary coordinate's change over the run."""
    return -(np.asarray(final, np.float64) - np.asarray(initial, np.float64))


CHECKS = ("noise_std", "sample_rate")
"""The mechanism checks a verdict makes room for (with correlated noise only the first is made, and the
second's share of the level goes unused: the verdict is then a little more conservative)."""
CHECK_SHARE = 0.02
"""Each check's share of the verdict's ``alpha``: ``alpha_c = 0.001`` at 95%, so 99.9% intervals."""
BOUNDS = 2
"""The white-box bounds of one verdict: the step (or prefix-sum) score's and the final model's."""


@dataclasses.dataclass(frozen=True)
class Levels:
    """The confidence of each test of one verdict at ``confidence`` (module doc): ``bound`` for each of the
    ``bounds`` one-run bounds, ``check`` for each of the :data:`CHECKS` intervals."""

    confidence: float
    bounds: int
    bound: float
    check: float

    @property
    def significances(self) -> list[float]:
        """``1 - level`` of every test of the verdict; they sum to ``1 - confidence``."""
        return [1 - self.bound] * self.bounds + [1 - self.check] * len(CHECKS)


def verdict_levels(confidence: float, bounds: int = BOUNDS) -> Levels:
    """``alpha = 1 - confidence`` split among ``bounds`` bounds and the :data:`CHECKS` (Bonferroni, module
    doc): ``alpha_c = alpha * CHECK_SHARE`` per check, ``alpha_b = (alpha - len(CHECKS) alpha_c) / bounds``
    per bound."""
    if not 0 < confidence < 1 or bounds < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1) and bounds={bounds} >= 1, e.g. 0.95 and 2")
    alpha = 1 - confidence
    check = alpha * CHECK_SHARE
    bound = (alpha - len(CHECKS) * check) / bounds
    return Levels(confidence, bounds, 1 - bound, 1 - check)


NOT_OBSERVED = ("no gradient step trained a canary's coordinate, so the run cannot be audited there: put the "
                "canaries on a variable every phase trains (--canary-variable)")


@dataclasses.dataclass(frozen=True)
class Interval:
    """A measured quantity, its interval at ``confidence`` and the ledger's claimed value."""

    estimate: float
    low: float
    high: float
    claimed: float
    confidence: float

    @property
    def matches(self) -> bool:
        return bool(self.low <= self.claimed <= self.high)


def noise_interval(noise: np.ndarray, claimed_std: float, confidence: float) -> Interval:
    """The standard deviation of ``noise`` (zero-mean draws) with its chi-square interval at ``confidence``."""
    values = np.asarray(noise, np.float64).ravel()
    values = values[np.isfinite(values)]
    k, total = values.size, float(np.sum(values**2))
    tail = (1 - confidence) / 2
    low, high = np.sqrt(total / stats.chi2.ppf(1 - tail, k)), np.sqrt(total / stats.chi2.ppf(tail, k))
    return Interval(float(np.sqrt(total / k)), float(low), float(high), float(claimed_std), confidence)


def rate_interval(observations: np.ndarray, clip_norm: float, noise_std: float, claimed_rate: float,
                  confidence: float) -> Interval:
    """The participation rate ``mean(x) / C`` of included canaries' observations, with its normal interval at
    ``confidence`` (the variance of ``x / C``: ``q (1 - q) + (sigma C / C)^2``, at the estimate)."""
    values = np.asarray(observations, np.float64).ravel() / clip_norm
    values = values[np.isfinite(values)]
    estimate = float(np.mean(values))
    rate = min(max(estimate, 0.0), 1.0)
    spread = np.sqrt((rate * (1 - rate) + (noise_std / clip_norm) ** 2) / values.size)
    half = stats.norm.ppf(1 - (1 - confidence) / 2) * spread
    return Interval(estimate, estimate - half, estimate + half, float(claimed_rate), confidence)


def mechanism_checks(observations: np.ndarray, included: np.ndarray, *, sample_rate: float, noise_std: float,
                     clip_norm: float, confidence: float, factor: np.ndarray | None = None) -> dict[str, Interval]:
    """:data:`CHECKS` measured on the canary coordinates against the claim (module doc), each at ``confidence``.
    ``factor``: BandMF's ``C`` (``[T, T]`` lower-triangular, the steps observed) to whiten correlated noise;
    None for independent noise. With correlated noise the rate is not checked (a canary's contribution is
    spread over its band)."""
    x = np.asarray(observations, np.float64)
    included = np.asarray(included, bool)
    if not np.isfinite(x).any():
        raise ValueError(NOT_OBSERVED)
    excluded = x[:, ~included]
    if factor is None:
        checks = {"noise_std": noise_interval(excluded, noise_std, confidence)}
        if included.any():
            checks["sample_rate"] = rate_interval(x[:, included], clip_norm, noise_std, sample_rate, confidence)
        return checks
    excluded = excluded[:, np.isfinite(excluded).all(axis=0)]  # whitening needs a canary's every step
    whitened = np.asarray(factor, np.float64) @ excluded / noise_std
    interval = noise_interval(whitened, 1.0, confidence)
    return {"noise_std": Interval(interval.estimate * noise_std, interval.low * noise_std, interval.high * noise_std,
                                  noise_std, confidence)}


@dataclasses.dataclass(frozen=True)
class WhiteBoxAudit:
    """The bounds of one white-box run: per score (``steps`` or ``prefix_sum``, and ``final_model``),
    the one-run bound, against the ledger's claim and the ceiling ``m`` canaries allow."""

    claimed_epsilon: float
    delta: float
    canaries: int
    observed_steps: int
    bounds: dict[str, OneRunBound]
    ceiling: float
    levels: Levels
    """The verdict's confidence and its split among the bounds and checks (:func:`verdict_levels`)."""
    checks: dict[str, Interval] = dataclasses.field(default_factory=dict)
    """The mechanism's parameters measured against the ledger (:func:`mechanism_checks`)."""
    expected: "SimulatedBound | None" = None
    """The ``steps`` bound an exact, honest mechanism gives with these canaries and steps
    (:class:`~sparta_tf.audit.power.SimulatedBound`, set by
    :func:`~sparta_tf.audit.white_box_run.white_box_report`): the yardstick of the measured one (independent
    noise only; None with correlated noise)."""

    @property
    def best(self) -> OneRunBound:
        return max(self.bounds.values(), key=lambda b: b.epsilon_lower_bound)

    @property
    def mismatches(self) -> list[str]:
        """The checked parameters whose claimed value is outside the measured interval."""
        return [name for name, check in self.checks.items() if not check.matches]

    @property
    def contradicts_claim(self) -> bool:
        """Whether some bound exceeds the claim (each bound at its level of :attr:`levels`: the report names
        which)."""
        return self.best.epsilon_lower_bound > self.claimed_epsilon

    def to_json(self) -> dict:
        """``audit.json``'s white-box fields; ``confidence`` is the verdict's, each bound and check holds its own
        level (their ``1 - level`` sum to ``1 - confidence`` with the other bounds of the verdict)."""
        return {"claimed_epsilon": self.claimed_epsilon, "delta": self.delta, "canaries": self.canaries,
                "confidence": self.levels.confidence, "observed_steps": self.observed_steps, "ceiling": self.ceiling,
                "contradicts_claim": self.contradicts_claim, "mismatches": self.mismatches,
                "bounds": {name: dataclasses.asdict(bound) for name, bound in self.bounds.items()},
                "checks": {name: dataclasses.asdict(check) | {"matches": check.matches}
                           for name, check in self.checks.items()},
                "expected_bound": None if self.expected is None else dataclasses.asdict(self.expected)}


def white_box_audit(observations: np.ndarray, included: np.ndarray, initial: np.ndarray, final: np.ndarray, *,
                    claimed_epsilon: float, delta: float, sample_rate: float, noise_std: float, clip_norm: float,
                    factor: np.ndarray | None = None, confidence: float = 0.95,
                    other_bounds: int = 0) -> WhiteBoxAudit:
    """Both bounds of a run (the step score, or the prefix sum with correlated noise, ``factor`` BandMF's
    ``C`` over the observed steps; and the final model's) and the :func:`mechanism_checks`, each at its
    share of ``confidence`` (:func:`verdict_levels`), so that the verdict holds at ``confidence``.
    ``other_bounds``: further bounds of the same verdict (the black-box bound of data canaries in the same
    run), which take their share at ``levels.bound`` too."""
    levels = verdict_levels(confidence, BOUNDS + other_bounds)
    each = levels.bound
    correlated = factor is not None
    scores = {"prefix_sum" if correlated else "steps": (
        prefix_sum_scores(observations) if correlated else
        step_scores(observations, sample_rate, noise_std, clip_norm)),
        "final_model": final_model_scores(initial, final)}
    bounds = {name: audit_scores(s, included, delta, each) for name, s in scores.items()}
    checks = mechanism_checks(observations, included, sample_rate=sample_rate, noise_std=noise_std,
                              clip_norm=clip_norm, confidence=levels.check, factor=factor)
    return WhiteBoxAudit(claimed_epsilon, delta, len(included), int(np.asarray(observations).shape[0]), bounds,
                         ceiling(len(included), delta, each), levels, checks)


def describe_audit(audit: WhiteBoxAudit) -> str:
    """One line: the claim, each bound, the ceiling, the checks and the verdict."""
    bounds = ", ".join(f"{name} {b.epsilon_lower_bound:.3g}" for name, b in audit.bounds.items())
    checks = "; ".join(f"{name} {c.estimate:.4g} [{c.low:.4g}, {c.high:.4g}] vs claimed {c.claimed:.4g}"
                       f"{'' if c.matches else ' MISMATCH'}" for name, c in audit.checks.items())
    verdict = ("CONTRADICTS the claim" if audit.contradicts_claim else
               "the mechanism does NOT match its ledger" if audit.mismatches else "consistent with the claim")
    expected = "" if audit.expected is None else (
        f"; an exact mechanism at the claim gives steps {audit.expected.mean:.3g} ({audit.expected.low:.3g} to "
        f"{audit.expected.high:.3g} in {audit.expected.trials} simulations)")
    levels = audit.levels
    return (f"white-box audit of epsilon {audit.claimed_epsilon:.4g} (delta {audit.delta:g}), {audit.canaries} canaries "
            f"over {audit.observed_steps} steps: lower bounds {bounds} (at most {audit.ceiling:.3g} with this many "
            f"canaries{expected}); measured {checks}: {verdict} (at {levels.confidence:.1%} confidence: each of "
            f"{levels.bounds} bounds at {levels.bound:.2%}, each check at {levels.check:.2%})")
