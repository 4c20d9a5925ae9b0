"""``SpartaSelector``: private row scoring and per-layer top-k (SPARTA, Algorithm 1).

The ``sparta``, ``dpsgd_grad`` and ``oracle`` methods run it in their
selection epoch (:mod:`sparta_tf.methods.selection_epoch`); standalone::

    selector = SpartaSelector(model, density=0.2)
    print(selector.group_table())
    selections = selector.select_epoch(dp_model, x, y)   # one epoch of Poisson batches

The selection epoch costs exactly one epoch of DP-SGD steps with the model's
``(q, sigma, C)`` and is recorded as such in the model's ledger. Only the
noisy, epoch-averaged scores and the resulting mask are ever released.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf

from sparta_tf import groups as groups_module
from sparta_tf.method_spec import SPECS
from sparta_tf.selection.scoring import SelectionScorer, check_score
from sparta_tf.selection.topk import check_density, selections_from_scores
from sparta_tf.trainable import VariableSelection

_SPARTA = SPECS["sparta"].defaults()
"""SPARTA's option defaults: the selector's."""


class SpartaSelector:
    """Scores the rows of every maskable kernel privately and keeps the top ``density`` per layer.

    Args:
      model: the Keras model (not the DPModel wrapper).
      density: fraction of rows (or entries) kept per layer (default: sparta's, the paper's 0.2).
      score: ``"sum_abs"`` (paper, sparta's default), ``"abs_sum"`` (authors' code),
        ``"signed"`` (Algorithm 2 baseline) or ``"oracle"`` (Algorithm 3, not private).
      granularity: ``"row"`` (SPARTA's default) or ``"entry"`` (ablation / baselines).
      density_overrides: ``{layer-or-variable name pattern: density}``.
      head: the classifier head layer or name (excluded from masking).
    """

    def __init__(
        self,
        model: tf.keras.Model,
        density: float = _SPARTA["density"],
        score: str = _SPARTA["score"],
        granularity: str = _SPARTA["granularity"],
        density_overrides: Mapping[str, float] | None = None,
        head=None,
    ):
        check_score(score, granularity)
        self.model = model
        self.density = check_density(density)
        self.score = score
        self.granularity = granularity
        self.density_overrides = dict(density_overrides or {})
        self.groups = groups_module.row_groups(model, head)
        self.scorer: SelectionScorer | None = None

    @property
    def private(self) -> bool:
        return self.score != "oracle"

    def group_table(self) -> str:
        return groups_module.group_table(self.model)

    def make_scorer(self, mechanism) -> SelectionScorer:
        """The scorer of a selection epoch run with ``mechanism`` (the DP model's ``dp.mechanism``)."""
        self.scorer = SelectionScorer(self.groups, mechanism, score=self.score, granularity=self.granularity)
        return self.scorer

    def select(self, scores: Sequence[np.ndarray] | None = None) -> list[VariableSelection]:
        """The kept rows/entries per layer, from ``scores`` (default: the scorer's epoch averages)."""
        if scores is None:
            if self.scorer is None:
                raise ValueError("no scores yet: run a selection epoch first (select_epoch, or a sparta method's fit)")
            scores = self.scorer.scores()
        return selections_from_scores(self.groups, scores, self.density, self.granularity, self.density_overrides)

    def select_epoch(self, dp_model, x, y, verbose: int = 0) -> list[VariableSelection]:
        """Runs one selection epoch of ``dp_model`` on ``x, y`` and returns the selections."""
        scorer = self.make_scorer(dp_model.mechanism)
        dp_model.begin_scoring(scorer)
        try:
            dp_model.fit(x, y, epochs=1, verbose=verbose)
        finally:
            dp_model.end_scoring()
        return self.select()
