"""Membership inference by a score threshold: ROC AUC and TPR at a fixed FPR.

The attack (loss threshold, Yeom et al. 2018, with a score ``s``; for the
plain attack ``s = -loss``) says *member* when ``s >= t``. Over members
``s_1..s_P`` and non-members ``s'_1..s'_N``::

    TPR(t) = #{i : s_i >= t} / P          FPR(t) = #{j : s'_j >= t} / N
    AUC    = P[s > s'] + P[s = s'] / 2    (Mann-Whitney: the area under the ROC curve)
    TPR@f  = max{TPR(t) : FPR(t) <= f}    over deterministic thresholds

An attack that guesses blindly has AUC 0.5 and TPR@f = f. With ``N``
non-members the smallest non-zero FPR is ``1/N``: when ``f < 1/N``,
``TPR@f`` is the fraction of members scored above *every* non-member, and
:func:`tpr_at_fpr` says so through :attr:`Roc.fpr_resolution`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from scipy import stats

__all__ = ["Roc", "roc_auc", "threshold_attack", "tpr_at_fpr"]


def _arrays(members: Sequence[float], non_members: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    members, non_members = np.asarray(members, np.float64), np.asarray(non_members, np.float64)
    if members.ndim != 1 or non_members.ndim != 1 or not len(members) or not len(non_members):
        raise ValueError("membership inference needs non-empty 1-D scores of members and of non-members")
    if not (np.all(np.isfinite(members)) and np.all(np.isfinite(non_members))):
        raise ValueError("membership scores must be finite (a NaN loss means training diverged)")
    return members, non_members


def roc_auc(members: Sequence[float], non_members: Sequence[float]) -> float:
    """``P[s > s'] + P[s = s'] / 2`` from the ranks of all scores (ties get their mean rank)."""
    members, non_members = _arrays(members, non_members)
    ranks = stats.rankdata(np.concatenate([members, non_members]))
    p, n = len(members), len(non_members)
    return float((ranks[:p].sum() - p * (p + 1) / 2) / (p * n))


def tpr_at_fpr(members: Sequence[float], non_members: Sequence[float], fpr: float) -> float:
    """``max{TPR(t) : FPR(t) <= fpr}`` over thresholds ``t`` (no randomised thresholds)."""
    members, non_members = _arrays(members, non_members)
    if not 0 <= fpr <= 1:
        raise ValueError(f"fpr={fpr} must be in [0, 1]")
    allowed = int(np.floor(fpr * len(non_members) + 1e-9))  # false positives allowed
    if allowed >= len(non_members):
        return 1.0
    # The lowest admissible threshold is just above the (allowed+1)-th largest non-member score.
    cut = np.sort(non_members)[::-1][allowed]
    return float(np.mean(members > cut))


@dataclasses.dataclass(frozen=True)
class Roc:
    """AUC and TPR at ``fpr`` of one threshold attack; ``fpr_resolution = 1 / #non-members``."""

    auc: float
    fpr: float
    tpr_at_fpr: float
    fpr_resolution: float
    members: int
    non_members: int


def threshold_attack(members: Sequence[float], non_members: Sequence[float], fpr: float = 1e-3) -> Roc:
    """The threshold attack's :class:`Roc` on member / non-member scores (higher = member)."""
    members, non_members = _arrays(members, non_members)
    return Roc(
        auc=roc_auc(members, non_members), fpr=fpr, tpr_at_fpr=tpr_at_fpr(members, non_members, fpr),
        fpr_resolution=1.0 / len(non_members), members=len(members), non_members=len(non_members),
    )
