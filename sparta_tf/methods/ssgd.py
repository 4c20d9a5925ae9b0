"""DP-SSGD as a method: pre-pruning before training, gradient dropping at every step.

Before training the prunable kernels are pre-pruned at rate ``prune_rate``
(``prune``: ``random`` and ``synflow`` look at no private data; ``dp_snip``
is one Gaussian mechanism on the whole training set with noise multiplier
``snip_noise_multiplier``, charged before training, and the training sigma is
calibrated so that both together spend the target); ``none`` skips it. Then
:class:`sparta_tf.ssgd.SSGDModel` trains the kept coordinates for all epochs
(phase ``dp_ssgd``), dropping a ``drop_rate`` fraction at every step
(``drop_mode``: ``random`` or ``magnitude``). The kept entries are saved to
``mask_dir`` with their provenance, so a resumed run reuses them.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from sparta_tf import masks, ssgd
from sparta_tf.method_spec import SPECS, Phase
from sparta_tf.methods.base import PreparedMethod, user_level
from sparta_tf.privacy.plan import Mechanism
from sparta_tf.trainable import entries

SNIP_PHASE, SNIP_KIND = "pre-pruning", "dp_snip"


class DpSsgd(PreparedMethod, spec=SPECS["dp_ssgd"]):
    """DP-SSGD (module doc); its options are attributes of the same names (``prune`` is ``"none"`` when
    ``prune_rate`` is 0)."""

    users_before_training = True  # DP-SNIP counts users at user level
    kept: list | None = None
    """The entries pre-pruning kept, as selections (None before :meth:`prepare`, or without pre-pruning)."""
    dp_model_class = ssgd.SSGDModel  # gradient dropping happens in SSGDModel's train step

    def __init__(self, **options):
        super().__init__(**options)
        if self.prune_rate == 0:
            self.prune = "none"

    @property
    def preparation(self) -> str | None:
        if self.prune == "none":
            return None
        return (f"pre-prunes a {self.prune_rate:g} fraction of the prunable kernels' weights ({self.prune}) "
                "before training")

    @property
    def trained_selections(self) -> list | None:
        return self.kept

    def mechanisms_before_training(self, n: int, sample_rate: float) -> list[Mechanism]:
        if self.prune != "dp_snip":
            return []
        return [Mechanism(SNIP_PHASE, 1.0, 1, self.snip_noise_multiplier, SNIP_KIND)]

    def planned_trainable(self, phase: Phase, model: tf.keras.Model) -> int | None:
        total = sum(int(np.prod(v.shape.as_list())) for v in model.trainable_variables)
        pruned = sum(int(np.prod(v.shape.as_list())) for v in ssgd.prunable_variables(model))
        return total - int(pruned * (self.prune_rate if self.prune != "none" else 0.0))

    def make_dp_model(self, model: tf.keras.Model, **dp_kwargs):
        return ssgd.SSGDModel(model, drop_rate=self.drop_rate, drop_mode=self.drop_mode, **dp_kwargs)

    def enter(self, phase: Phase, dp) -> None:
        """Nothing: the trainable set is the pre-pruned one, which prepare set."""

    def prepare(self, dp, x, y, loss, plan, first_epoch: int = 0, users=None) -> dict:
        self.check_ready(dp, before_prepare=True)  # pruning needs SSGDModel.set_keep_masks
        if self.prune == "none":
            self.mark_prepared(dp)
            return {"prune": "none"}
        self.need_arrays(x, y)
        if first_epoch and self.prune == "dp_snip" and not masks.has_mask(self.mask_dir):
            raise ValueError(f"this fit resumes after DP-SNIP's pre-pruning, but its keep masks are not saved "
                             f"(mask_dir={self.mask_dir!r}); pruning again would release a second DP-SNIP "
                             "statistic with the first one's noise: start a new run_dir")
        if first_epoch and masks.has_mask(self.mask_dir):  # resumed: pruned (and charged) already
            selections, _ = masks.load_mask(self.mask_dir, dp.model)
            kept = {id(s.variable): s.dense_mask() for s in selections}
            self._keep(dp, [(v, kept.get(id(v), np.zeros(v.shape.as_list(), bool)))
                            for v in ssgd.prunable_variables(dp.model)])
            self.mark_prepared(dp)
            return {"prune": self.prune, "kept_fraction_of_pruned_kernels": "reloaded"}
        keep = self._prune(dp, x, y, loss, users)
        self._keep(dp, keep)
        if self.mask_dir is not None:
            provenance = (masks.MaskProvenance.of_ledger(dp.ledger) if self.prune == "dp_snip"
                          else masks.MaskProvenance.public())
            masks.save_mask(self.mask_dir, self.kept, dp.model, provenance=provenance,
                            method=self.name, prune=self.prune, prune_rate=self.prune_rate)
        self.mark_prepared(dp)
        return {"prune": self.prune, "kept_fraction_of_pruned_kernels": float(ssgd.keep_fraction(keep))}

    def _keep(self, dp, keep: ssgd.KeepMasks) -> None:
        """Trains the entries ``keep`` keeps, which :attr:`trained_selections` then names."""
        dp.set_keep_masks(keep)
        self.kept = [s for s in (entries(v, m) for v, m in keep) if s is not None]

    def _prune(self, dp, x, y, loss, users=None) -> ssgd.KeepMasks:
        if self.prune == "random":
            return ssgd.prune_random(dp.model, self.prune_rate, seed=dp.public_seed)
        if self.prune == "synflow":
            return ssgd.prune_synflow(dp.model, self.prune_rate, iterations=self.synflow_iterations)
        return ssgd.prune_dp_snip(dp.model, x, y, loss, self.prune_rate, self.snip_noise_multiplier, dp.clip_norm,
                                  1.0, dp.ledger, seed=dp.seed, **user_level(dp, users))
