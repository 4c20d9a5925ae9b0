"""The audit report: the one-run bound and the membership attacks of one run, as JSON.

``audit_report`` turns a run's canaries and their losses at the start and
the end of training into the fields of ``audit.json``:

* ``epsilon_lower_bound`` (:mod:`sparta_tf.audit.one_run`) from the canary
  scores (:mod:`sparta_tf.audit.scores`, ``-loss`` by default), at the run's
  ``delta`` with ``confidence``; ``epsilon_ceiling`` is the largest bound
  these many canaries could show (every guess right);
* ``mia_auc`` and ``mia_tpr_at_fpr_1e-3`` (:mod:`sparta_tf.audit.membership`)
  of the loss-threshold attack (score ``-loss`` at the end) on the canaries,
  included ones as members and left-out ones as non-members;
  ``canary_score_auc`` is the AUC of the audit's score;
* ``passed``: ``epsilon_lower_bound <= epsilon_claimed`` (``None`` for a run
  that claims no epsilon);
* ``canary_seed``: the seed of the canary stream when the caller chose it
  (``seed_given``), else ``None``: a seed drawn for the audit is not
  published, since it may be derived from the run's own seed.
"""

from __future__ import annotations

import numpy as np

from sparta_tf.audit.canaries import Canaries
from sparta_tf.audit.membership import roc_auc, threshold_attack
from sparta_tf.audit.one_run import audit_scores, ceiling
from sparta_tf.audit.scores import canary_scores

__all__ = ["audit_report", "summary_line"]

FPR = 1e-3


def audit_report(
    canaries: Canaries,
    loss_start: np.ndarray,
    loss_end: np.ndarray,
    *,
    delta: float,
    epsilon_claimed: float | None,
    confidence: float = 0.95,
    score: str = "loss",
    seed_given: bool = True,
) -> dict:
    """The ``audit.json`` fields (module docstring) for one run's canaries."""
    if not len(loss_start) == len(loss_end) == len(canaries):
        raise ValueError(f"need one start and one end loss per canary ({len(canaries)}), "
                         f"got {len(loss_start)} and {len(loss_end)}")
    included = canaries.included
    if included.all() or not included.any():
        raise ValueError("every canary fell on the same side of the coin; use more canaries")
    scores = canary_scores(loss_start, loss_end, score)
    bound = audit_scores(scores, included, delta, confidence)
    loss_end = np.asarray(loss_end, np.float64)
    attack = threshold_attack(-loss_end[included], -loss_end[~included], FPR)
    lower = bound.epsilon_lower_bound
    return {
        "epsilon_claimed": epsilon_claimed,
        "epsilon_lower_bound": lower,
        "confidence": confidence,
        "delta": delta,
        "passed": None if epsilon_claimed is None else bool(lower <= epsilon_claimed),
        "epsilon_ceiling": ceiling(len(canaries), delta, confidence),
        "canaries": len(canaries),
        "canaries_included": bound.included,
        "canary_kind": canaries.kind,
        "canary_seed": canaries.seed if seed_given else None,
        "score": score,
        "guesses": bound.guesses,
        "correct_guesses": bound.correct,
        "k_plus": bound.k_plus,
        "k_minus": bound.k_minus,
        "guess_counts_tried": bound.guess_counts_tried,
        "canary_score_auc": roc_auc(scores[included], scores[~included]),
        "mia_attack": "loss_threshold",
        "mia_auc": attack.auc,
        "mia_tpr_at_fpr_1e-3": attack.tpr_at_fpr,
        "mia_fpr_resolution": attack.fpr_resolution,
    }


def summary_line(report: dict) -> str:
    """One line for the run's stdout: claim, bound, confidence, canaries, MIA."""
    claimed = report["epsilon_claimed"]
    claim = "no epsilon claimed (not DP)" if claimed is None else f"epsilon claimed {claimed:.4g}"
    verdict = {True: "consistent with the claim", False: "CONTRADICTS THE CLAIM", None: ""}[report["passed"]]
    if report["passed"] and report["epsilon_ceiling"] <= claimed:
        verdict += " (these canaries cannot show more than the ceiling, so no run could contradict it)"
    return (f"== audit: {claim}, lower bound {report['epsilon_lower_bound']:.4g} "
            f"({report['confidence']:.0%} confidence, delta {report['delta']:g}, {report['canaries']} "
            f"{report['canary_kind']} canaries, ceiling {report['epsilon_ceiling']:.3g}) {verdict}; "
            f"loss-threshold MIA AUC {report['mia_auc']:.3f}, TPR {report['mia_tpr_at_fpr_1e-3']:.3f} "
            f"at FPR 1e-3")
