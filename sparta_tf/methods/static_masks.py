"""Masks chosen before training without looking at private data: ``mp`` and ``random``.

* ``mp`` (Luo et al. 2021; the SPARTA paper's Algorithm 4): per layer the
  entries (default) or rows of largest ``|W_pretrained|``. The pre-trained
  weights are public, so the mask costs nothing.
* ``random``: per layer uniformly random rows (default) or entries, from
  the ``"random_mask"`` stream of the run's public seed (the DP model's
  :attr:`~sparta_tf.DPModel.public_seed`, independent of the secret run
  seed unless one seed was given), or of ``seed`` when given: an explicit
  override, e.g. to keep one mask across runs of different seeds (the
  paper's "Random-Groups").

Both train the DP-BitFit set plus the mask for all ``T`` epochs (one phase,
named after the method). The mask is computed at the start of the fit from
the weights at that moment (the pre-trained ones), saved, and reloaded by a
resumed run.
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf import masks
from sparta_tf.groups import row_groups
from sparta_tf.method_spec import SPECS, Phase
from sparta_tf.methods.masked import MaskedMethod
from sparta_tf.selection.static import magnitude_selections, random_selections
from sparta_tf.trainable import TrainableSet


class StaticMaskMethod(MaskedMethod):
    """The DP-BitFit set plus a mask chosen at the start of the fit from the weights then (one phase)."""

    def choose_mask(self, model: tf.keras.Model, public_seed: int) -> list:
        """The mask for ``model``; ``public_seed``: the DP model's :attr:`~sparta_tf.DPModel.public_seed`, for
        masks drawn at random (a random mask can be read off the release, so never the secret run seed)."""
        raise NotImplementedError

    def trainable_set(self, phase: Phase, model: tf.keras.Model) -> TrainableSet | None:
        return None if self.mask_selections is None else self.masked_set(model)

    def planned_trainable(self, phase: Phase, model: tf.keras.Model) -> int | None:
        if self.mask_selections is None:  # the kept count per layer does not depend on which are kept
            return self.expected_masked_size(model)
        return super().planned_trainable(phase, model)

    def start(self, dp, epochs: int, first_epoch: int = 0) -> None:
        if first_epoch and self.reload_own_mask(dp.model):
            return
        self.mask_selections = self.choose_mask(dp.model, dp.public_seed)
        self.save_mask(dp.model, masks.MaskProvenance.public())


class MagnitudePruning(StaticMaskMethod, spec=SPECS["mp"]):
    """Per layer the entries (or rows) of largest pre-trained ``|W|`` (paper Alg. 4)."""

    def choose_mask(self, model: tf.keras.Model, public_seed: int) -> list:
        groups = row_groups(model, self.head)
        return magnitude_selections(groups, self.density, self.granularity, self.density_overrides)


class RandomMask(StaticMaskMethod, spec=SPECS["random"]):
    """Per layer uniformly random rows (or entries): the ``"random_mask"`` stream of the run's public seed,
    or of the ``seed`` option when given (an explicit override)."""

    def choose_mask(self, model: tf.keras.Model, public_seed: int) -> list:
        seed = public_seed if self.seed is None else self.seed
        groups = row_groups(model, self.head)
        return random_selections(groups, self.density, self.granularity, seed, self.density_overrides)
