"""Methods that choose their mask in a selection epoch: ``sparta``, ``dpsgd_grad`` and ``oracle``.

For a fit of ``T`` epochs and ``warmup_epochs = T0`` (default ``T / 5``, the
paper's 10 of 50):

* ``warmup`` (epochs ``[0, T0)``): DP-SGD on biases + norms + head (DP-BitFit);
* ``selection`` (epoch ``T0``): every step is one Poisson-subsampled Gaussian
  mechanism with the run's ``(q, sigma, C)`` that releases a noisy mask
  statistic and updates no weight (:mod:`sparta_tf.selection.scoring`); at
  its end the per-layer top rows (or entries) are kept and the mask is saved;
* ``sparse`` (epochs ``(T0, T)``): DP-SGD on the DP-BitFit set plus the mask.

So the ledger holds exactly ``T`` epochs of steps with one ``(q, sigma)``
(the paper's Prop. 4.2). Scores: ``sparta`` ``sum_abs`` (paper, default) or
``abs_sum`` (authors' code), rows; ``dpsgd_grad`` the averaged noisy DP-SGD
gradient (paper Alg. 2), entries; ``oracle`` exact ``|g|`` without clipping
or noise (Alg. 3), entries, NOT private: the ledger marks the run.

With ``mask`` (a saved mask directory) the selection epoch is skipped and
epochs ``[T0, T)`` are sparse; what choosing that mask spent (its recorded
ledger entries) is charged before training, and a non-private mask marks the
run non-private (:class:`sparta_tf.masks.MaskProvenance`).
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf import masks
from sparta_tf.method_spec import SPECS, Phase, default_warmup_epochs
from sparta_tf.methods.masked import MaskedMethod
from sparta_tf.methods.sets import warmup_set
from sparta_tf.privacy.plan import Mechanism
from sparta_tf.selection.scoring import check_score
from sparta_tf.selection.selector import SpartaSelector
from sparta_tf.trainable import TrainableSet

WARMUP, SELECTION, SPARSE = "warmup", "selection", "sparse"


class SelectionEpochMethod(MaskedMethod):
    """Warm-up, one selection epoch that releases a noisy score per row (or entry), then the sparse phase.

    Options (attributes of the same names): ``warmup_epochs``, ``score``, ``mask`` (a saved mask directory)
    and the mask options of :class:`~sparta_tf.methods.masked.MaskedMethod`."""

    selector: SpartaSelector | None = None
    """The selection epoch's scorer and top-k (while it runs and after)."""

    def __init__(self, **options):
        super().__init__(**options)
        check_score(self.score, self.granularity)
        self._provenance = None if self.mask is None else masks.read_provenance(self.mask)

    # ------------------------------------------------------------------ plan

    def warmup_for(self, epochs: int) -> int:
        return default_warmup_epochs(epochs) if self.warmup_epochs is None else self.warmup_epochs

    def phases(self, epochs: int) -> list[Phase]:
        warmup = self.warmup_for(epochs)
        selection = 0 if self.mask is not None else 1
        if warmup + selection >= epochs:
            raise ValueError(
                f"warmup_epochs={warmup} leaves no sparse epoch in a fit of {epochs} epochs; use warmup_epochs "
                f"<= {max(epochs - 1 - selection, 0)} (paper: T0 = T/5)")
        phases = [self.spec.phase(WARMUP).lasting(warmup)] if warmup else []
        if selection:
            phases.append(self.spec.phase(SELECTION).lasting(1))
        return phases + [self.spec.phase(SPARSE).lasting(epochs - warmup - selection)]

    def mechanisms_before_training(self, n: int, sample_rate: float) -> list[Mechanism]:
        if self._provenance is None:
            return []
        return [Mechanism(e.phase, e.sample_rate, e.count, e.noise_multiplier, e.kind, draws_noise=False, bands=e.bands)
                for e in self._provenance.charged_entries()]

    def unit_of_recorded_mechanisms(self) -> str | None:
        return None if self._provenance is None or not self._provenance.entries else self._provenance.unit

    def nonprivate_reasons(self) -> list[str]:
        reasons = [] if self.private else [f"{self.name}: mask chosen from non-private gradients"]
        if self._provenance is not None:
            reasons += [f"{reason} (loaded from {self.mask})" for reason in self._provenance.reasons]
        return reasons

    def trainable_set(self, phase: Phase, model: tf.keras.Model) -> TrainableSet | None:
        if phase.name == WARMUP:
            return warmup_set(model, self.head, self.head_learning_rate_scale)
        if phase.name == SELECTION or self.mask_selections is None:
            return None
        return self.masked_set(model)

    def planned_trainable(self, phase: Phase, model: tf.keras.Model) -> int | None:
        if phase.name == SPARSE and self.mask_selections is None:
            return self.expected_masked_size(model)
        return super().planned_trainable(phase, model)

    # ------------------------------------------------------------------ run

    def check(self, model: tf.keras.Model) -> None:
        super().check(model)
        if self.mask is not None:
            masks.load_mask(self.mask, model)  # refuses a damaged mask or one of another model

    def start(self, dp, epochs: int, first_epoch: int = 0) -> None:
        if self.mask is not None:
            self.mask_selections, _ = masks.load_mask(self.mask, dp.model)
            if first_epoch == 0 and dp.ledger is not None:  # a resumed run's ledger holds the charge already
                self._provenance.charge(dp.ledger, self.mask)
        elif first_epoch > self.warmup_for(epochs):
            if not self.reload_own_mask(dp.model):
                raise ValueError("this fit starts after the selection epoch but no mask is available; pass "
                                 "mask=<dir of the saved mask> (or the mask_dir of the interrupted run)")

    def enter(self, phase: Phase, dp) -> None:
        if phase.name != SELECTION:
            return super().enter(phase, dp)
        self.selector = SpartaSelector(dp.model, self.density, self.score, self.granularity,
                                       self.density_overrides, self.head)
        dp.begin_scoring(self.selector.make_scorer(dp.mechanism))

    def leave(self, phase: Phase, dp) -> None:
        if phase.name != SELECTION:
            return
        self.mask_selections = self.selector.select()
        dp.end_scoring()
        if dp.privacy_callback is not None:
            dp.privacy_callback.flush()  # the selection steps are in the ledger before it is recorded
        provenance = (masks.MaskProvenance.of_ledger(dp.ledger) if dp.ledger is not None else
                      masks.MaskProvenance(private=False, reasons=("chosen by a DPModel without a ledger",)))
        self.save_mask(dp.model, provenance, score=self.score)


class Sparta(SelectionEpochMethod, spec=SPECS["sparta"]):
    """SPARTA (Makni et al., KDD 2025, Algorithm 1): private row scores, top rows per layer."""


class DpsgdGrad(SelectionEpochMethod, spec=SPECS["dpsgd_grad"]):
    """The paper's Algorithm 2: entries of largest averaged noisy DP-SGD gradient."""


class Oracle(SelectionEpochMethod, spec=SPECS["oracle"]):
    """The paper's Algorithm 3: entries of largest exact ``|g|``. NOT differentially private."""
