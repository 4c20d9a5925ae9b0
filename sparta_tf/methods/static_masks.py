"""Masks chosen before training without looking at private data: ``mp`` and ``random``.

* ``mp`` (Luo et al. 2021; the SPARTA paper's Algorithm 4): per layer the
  entries (default) or rows of largest ``|W_pretrained|``. The pre-trained
  weights are public, so the mask costs nothing.
* ``random``: per layer uniformly random rows (default) or entries, from
  the ``"random_mask"`` stream of ``seed`` (the paper's "Random-Groups").

Both train the DP-BitFit set plus the mask for all ``T`` epochs (one phase,
named after the method). The mask is computed at the start of the fit from
the weights at that moment (the pre-trained ones), saved, and reloaded by a
resumed run.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf import masks
from sparta_tf.groups import row_groups
from sparta_tf.methods.base import single_phase
from sparta_tf.methods.masked import MASK_OPTIONS, MaskedMethod
from sparta_tf.privacy.plan import TrainingPhase
from sparta_tf.selection.static import magnitude_selections, random_selections
from sparta_tf.trainable import TrainableSet


class StaticMaskMethod(MaskedMethod):
    def phases(self, epochs: int) -> list[TrainingPhase]:
        return single_phase(self.name, epochs)

    def choose_mask(self, model: tf.keras.Model) -> list:
        raise NotImplementedError

    def trainable_set(self, phase: TrainingPhase, model: tf.keras.Model) -> TrainableSet:
        if self.mask_selections is None:
            self.mask_selections = self.choose_mask(model)
        return self.masked_set(model)

    def start(self, dp, epochs: int, first_epoch: int = 0) -> None:
        if first_epoch and self.reload_own_mask(dp.model):
            return
        self.mask_selections = self.choose_mask(dp.model)
        self.save_mask(dp.model, masks.MaskProvenance.public())


class MagnitudePruning(StaticMaskMethod):
    name = "mp"
    options = MASK_OPTIONS
    default_granularity = "entry"

    def configure(self, **options) -> None:
        self.configure_mask(**options)

    def choose_mask(self, model: tf.keras.Model) -> list:
        groups = row_groups(model, self.head)
        return magnitude_selections(groups, self.density, self.granularity, self.density_overrides)


class RandomMask(StaticMaskMethod):
    name = "random"
    options = MASK_OPTIONS + ("seed",)

    def configure(self, seed: int = 0, **options) -> None:
        self.seed = int(seed)
        self.configure_mask(**options)

    def choose_mask(self, model: tf.keras.Model) -> list:
        groups = row_groups(model, self.head)
        return random_selections(groups, self.density, self.granularity, self.seed, self.density_overrides)
