"""The one-run epsilon lower bound (Steinke, Nasr and Jagielski, NeurIPS 2023).

The game. ``m`` canaries; canary ``i`` is put into the training set
independently with probability 1/2 (``S_i = 1``) or left out (``S_i = 0``).
After one training run the auditor scores every canary (higher = "looks
included") and guesses: *in* for the ``k+`` highest scores, *out* for the
``k-`` lowest, and abstains on the rest. ``r = k+ + k-`` guesses, ``v`` of
them correct.

The bound (the paper's Theorem 3.1, with abstentions). If training is
``(eps, delta)``-DP with respect to adding or removing one canary, then for
every ``v``::

    P[V >= v] <= P[W >= v] + 2 m delta * max_{1 <= i <= v} P[v - i <= W < v] / i,
    W ~ Binomial(r, p(eps)),  p(eps) = e^eps / (1 + e^eps)

(``p(eps)`` is the accuracy of eps-DP randomised response: no DP mechanism
lets a guesser beat it on average). The right-hand side, :func:`p_value`,
is the p-value of the hypothesis "training is (eps, delta)-DP" given ``v``
correct guesses out of ``r``. It grows with ``eps``; every ``eps`` whose
p-value is at most ``alpha = 1 - confidence`` is rejected, and

    eps_lb = min{eps >= 0 : p_value(eps) > alpha}

is a lower bound on the true epsilon with confidence ``1 - alpha``: if the
run is ``(eps*, delta)``-DP then, with probability ``>= 1 - alpha``,
``p_value(eps*) > alpha`` and so ``eps_lb <= eps*``.

Searching over guess counts. The best ``(k+, k-)`` is not known in advance.
:func:`audit_scores` tries a fixed grid of guess counts chosen from ``m``
alone (:func:`guess_grid`: one-sided top-``k`` and two-sided top/bottom-``k``
for ``k`` in 1, 2, 5, 10, 20, 50, ...) and tests each at ``alpha / |grid|``
(Bonferroni), so the maximum over the grid is still a lower bound with
confidence ``1 - alpha``. (Taking the best ``k`` after seeing the scores
without such a correction would overstate the confidence.)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from scipy import special, stats

__all__ = ["OneRunBound", "audit_scores", "ceiling", "epsilon_lower_bound", "guess_grid", "p_value"]

_GRID_POINTS = 200  # resolution of the first-crossing scan in epsilon_lower_bound
_TOLERANCE = 1e-6  # absolute tolerance on the returned epsilon


def _check_counts(m: int, r: int, v: int) -> None:
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= correct ({v}) <= guesses ({r}) <= canaries ({m})")


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """``P[V >= v]`` bound of the module docstring: the p-value of ``(epsilon, delta)``-DP.

    ``m`` canaries, ``r`` guesses, ``v`` correct guesses.
    """
    _check_counts(m, r, v)
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and 0 <= delta <= 1, got {epsilon}, {delta}")
    p = special.expit(epsilon)
    tail = stats.binom.sf(v - 1, r, p)  # P[W >= v]
    if delta == 0 or v == 0:
        return float(min(1.0, tail))
    i = np.arange(1, v + 1)
    window = stats.binom.sf(v - 1 - i, r, p) - tail  # P[v - i <= W < v]
    return float(min(1.0, tail + 2 * m * delta * np.max(window / i)))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, significance: float = 0.05) -> float:
    """``min{eps >= 0 : p_value(m, r, v, eps, delta) > significance}``: the rejected range's end.

    The first crossing is found by doubling an upper end until the p-value
    exceeds ``significance``, scanning ``[0, upper]`` on a grid and bisecting
    between the last rejected and the first kept grid point.
    """
    _check_counts(m, r, v)
    if not 0 < significance < 1:
        raise ValueError(f"significance={significance} must be in (0, 1)")

    def rejected(eps: float) -> bool:
        return p_value(m, r, v, eps, delta) <= significance

    if not rejected(0.0):
        return 0.0
    upper = 1.0
    while rejected(upper):
        upper *= 2
        if upper > 1e4:  # p(eps) -> 1 for every v <= r, so this means a bug, not a big epsilon
            raise RuntimeError(f"no epsilon is kept for m={m}, r={r}, v={v}, delta={delta}")
    grid = np.linspace(0.0, upper, _GRID_POINTS + 1)
    first_kept = next(k for k, eps in enumerate(grid) if not rejected(float(eps)))
    low, high = float(grid[first_kept - 1]), float(grid[first_kept])
    while high - low > _TOLERANCE:
        middle = 0.5 * (low + high)
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low


def guess_grid(m: int) -> list[tuple[int, int]]:
    """``(k+, k-)`` guess counts tried for ``m`` canaries: top-k and top/bottom-k, ``k`` in 1, 2, 5, 10, ..."""
    if m < 2:
        raise ValueError(f"an audit needs at least 2 canaries, got {m}")
    ks, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > m // 2:
                return [(k, 0) for k in ks] + [(k, k) for k in ks]
            ks.append(step * scale)
        scale *= 10


@dataclasses.dataclass(frozen=True)
class OneRunBound:
    """The result of :func:`audit_scores`.

    ``epsilon_lower_bound`` holds with probability ``confidence`` over the
    canaries' coin flips; ``k_plus``/``k_minus``/``guesses``/``correct`` are
    those of the guess counts that gave it (all zero when nothing is rejected).
    """

    epsilon_lower_bound: float
    confidence: float
    delta: float
    canaries: int
    included: int
    k_plus: int
    k_minus: int
    guesses: int
    correct: int
    guess_counts_tried: int


def _correct_guesses(order: np.ndarray, included: np.ndarray, k_plus: int, k_minus: int) -> int:
    """Correct guesses: canaries guessed in among the top ``k_plus`` + guessed out among the bottom ``k_minus``."""
    top = included[order[len(order) - k_plus:]].sum() if k_plus else 0
    bottom = (~included[order[:k_minus]]).sum() if k_minus else 0
    return int(top + bottom)


def audit_scores(
    scores: Sequence[float], included: Sequence[bool], delta: float, confidence: float = 0.95
) -> OneRunBound:
    """The one-run epsilon lower bound from canary ``scores`` (higher = more likely included).

    ``included[i]`` is canary ``i``'s coin flip. Tries every ``(k+, k-)`` of
    :func:`guess_grid` at significance ``(1 - confidence) / |grid|`` and
    returns the largest bound (see the module docstring).
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and included {included.shape} must be 1-D of the same length")
    if not np.all(np.isfinite(scores)):
        raise ValueError("canary scores must be finite (a NaN loss means training diverged)")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be in (0, 1), e.g. 0.95")
    m = len(scores)
    grid = guess_grid(m)
    significance = (1 - confidence) / len(grid)
    order = np.argsort(scores, kind="stable")  # ascending: the top k are the last k
    best = (0.0, 0, 0, 0, 0)
    for k_plus, k_minus in grid:
        correct = _correct_guesses(order, included, k_plus, k_minus)
        bound = epsilon_lower_bound(m, k_plus + k_minus, correct, delta, significance)
        if bound > best[0]:
            best = (bound, k_plus, k_minus, k_plus + k_minus, correct)
    bound, k_plus, k_minus, guesses, correct = best
    return OneRunBound(
        epsilon_lower_bound=bound, confidence=confidence, delta=delta, canaries=m, included=int(included.sum()),
        k_plus=k_plus, k_minus=k_minus, guesses=guesses, correct=correct, guess_counts_tried=len(grid),
    )



def ceiling(m: int, delta: float, confidence: float = 0.95) -> float:
    """The largest bound :func:`audit_scores` can return for ``m`` canaries: every guess right.

    A run whose true epsilon exceeds this cannot be told apart from one at
    the ceiling: the audit's resolution, set by ``m``, ``delta`` and the
    confidence alone.
    """
    grid = guess_grid(m)
    significance = (1 - confidence) / len(grid)
    return max(epsilon_lower_bound(m, kp + km, kp + km, delta, significance) for kp, km in grid)
