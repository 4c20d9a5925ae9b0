"""Mask selection: SPARTA's private row scores, the paper's baselines, per-layer top-k."""

from sparta_tf.selection.scoring import GRANULARITIES, SCORES, SelectionScorer
from sparta_tf.selection.selector import SpartaSelector
from sparta_tf.selection.static import magnitude_selections, random_selections
from sparta_tf.selection.topk import kept_count, selections_from_scores

__all__ = [
    "GRANULARITIES",
    "SCORES",
    "SelectionScorer",
    "SpartaSelector",
    "kept_count",
    "magnitude_selections",
    "random_selections",
    "selections_from_scores",
]
