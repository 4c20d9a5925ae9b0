"""DP-FROST as a method: the layers (partitions) PSEL selects, chosen before training.

Before training, ``frost_iterations`` (T) rounds of noisy partition-gradient
magnitudes at Poisson rate ``q_ps`` (:func:`sparta_tf.selection.frost.frost_select`,
the ``"frost_selection"`` mechanism); then DP-SGD on the selected
partitions (whole kernels + biases) for all epochs (phase ``dp_frost``).
ComputeSigma's budget split: the training sigma spends ``r_eps`` of the
target on its own, the selection sigma the rest
(:func:`sparta_tf.privacy.plan.make_privacy_plan` with ``training_share=r_eps``).
The selected partitions are saved to ``mask_dir`` with their provenance, so
a resumed run reuses them instead of selecting (and paying) again.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf import masks
from sparta_tf.method_spec import SPECS, Phase
from sparta_tf.methods.base import PreparedMethod, SetMethod, user_level
from sparta_tf.privacy.plan import Mechanism
from sparta_tf.selection import frost
from sparta_tf.trainable import TrainableSet


class DpFrost(PreparedMethod, SetMethod, spec=SPECS["dp_frost"]):
    """DP-FROST (module doc); its options are attributes of the same names."""

    selected: TrainableSet | None = None
    """The partitions PSEL selected (None before :meth:`prepare`)."""
    users_before_training = True  # its rounds sample users at user level

    @property
    def trained_selections(self) -> list | None:
        return None if self.selected is None else list(self.selected)

    def mechanisms_before_training(self, n: int, sample_rate: float) -> list[Mechanism]:
        return [Mechanism(frost.SELECTION_PHASE, self.q_ps, self.frost_iterations, None, frost.SELECTION_KIND)]

    @property
    def training_share(self) -> float:
        return self.r_eps

    @property
    def preparation(self) -> str:
        return "chooses the partitions it trains before training (DP-FROST's selection rounds)"

    def trainable_set(self, phase: Phase, model: tf.keras.Model) -> TrainableSet | None:
        return self.selected

    def prepare(self, dp, x, y, loss, plan, first_epoch: int = 0, users=None) -> dict:
        self.need_arrays(x, y)
        if first_epoch:  # resumed: the selection was made (and charged) already
            if not masks.has_mask(self.mask_dir):
                raise ValueError(f"this fit resumes after {self.name}'s selection, but the selection is not saved "
                                 f"(mask_dir={self.mask_dir!r}); choosing again would release a second selection "
                                 "with the first one's noise: start a new run_dir")
            selections, _ = masks.load_mask(self.mask_dir, dp.model)
            self.selected = TrainableSet(selections)
            self.mark_prepared(dp)
            return {"frost_selected_partitions": "reloaded"}
        (selection,) = plan.before_training
        self.selected, info = frost.frost_select(
            dp.model, x, y, loss, target_epsilon=plan.run_budget, delta=plan.delta,
            sample_rate=plan.sample_rate, steps=plan.steps, gamma=self.gamma, method=self.frost_magnitude,
            alpha=self.frost_alpha, clip_norm=dp.clip_norm, r_eps=self.r_eps, iterations=self.frost_iterations,
            q_ps=self.q_ps, nu=self.nu, accountant=plan.accountant, ledger=dp.ledger, seed=dp.seed,
            noise_multiplier=selection.noise_multiplier, **user_level(dp, users),
        )
        if self.mask_dir is not None:
            masks.save_mask(self.mask_dir, list(self.selected), dp.model,
                            provenance=masks.MaskProvenance.of_ledger(dp.ledger), method=self.name)
        self.mark_prepared(dp)
        return {"frost_selected_partitions": [str(s) for s in info.get("selected", [])],
                "frost_sigma_selection": float(info["sigma_selection"])}
