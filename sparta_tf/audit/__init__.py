"""Empirical privacy audit: canaries, the one-run epsilon lower bound, membership inference.

A DP guarantee is an upper bound proved on paper; an audit measures a lower
bound on one real run (Steinke, Nasr and Jagielski, NeurIPS 2023):
:func:`plant_canaries` puts each of ``m`` canaries into the training set with
probability 1/2, :class:`LossRecorder` records their losses before and after
``fit``, and :func:`audit_report` turns their scores into an epsilon lower
bound at 95% confidence and a loss-threshold membership attack. A bound
above the claimed epsilon means the claim is false (or the run is not the
mechanism that was analysed); a bound below it proves nothing about
tightness. ``sparta-audit`` (:mod:`trainers.audit`) runs all of it through
``sparta-train``'s pipeline.
"""

from sparta_tf.audit.canaries import CANARY_KINDS, Canaries, plant_canaries
from sparta_tf.audit.membership import Roc, roc_auc, threshold_attack, tpr_at_fpr
from sparta_tf.audit.one_run import OneRunBound, audit_scores, ceiling, epsilon_lower_bound, p_value
from sparta_tf.audit.report import audit_report, summary_line
from sparta_tf.audit.scores import SCORES, LossRecorder, canary_scores, per_example_loss

__all__ = [
    "CANARY_KINDS",
    "SCORES",
    "Canaries",
    "LossRecorder",
    "OneRunBound",
    "Roc",
    "audit_report",
    "audit_scores",
    "canary_scores",
    "ceiling",
    "epsilon_lower_bound",
    "p_value",
    "per_example_loss",
    "plant_canaries",
    "roc_auc",
    "summary_line",
    "threshold_attack",
    "tpr_at_fpr",
]
