"""Keras callbacks that run a fine-tuning method inside ``DPModel.fit``.

:class:`MethodCallback` drives any method of :mod:`sparta_tf.methods`;
:class:`SpartaCallback` is SPARTA (Algorithm 1) with its options. For a fit
of ``T`` epochs and ``warmup_epochs = T0``:

* epochs ``[0, T0)``: warm-up, DP-SGD on biases + norms + head (DP-BitFit);
* epoch ``T0``: the selection epoch. Every step is one Poisson-subsampled
  Gaussian mechanism with the run's ``(q, sigma, C)`` that releases a noisy
  mask statistic and updates no weight (:mod:`sparta_tf.selection.scoring`);
  at its end the per-layer top rows are kept and the mask is saved;
* epochs ``(T0, T)``: sparse DP-SGD on the selected rows + the warm-up set.

So the ledger holds exactly ``T`` epochs of steps with one ``(q, sigma)``
(the paper's Prop. 4.2): calibrate ``sigma`` for ``T`` epochs up front. The
ledger labels the steps ``warmup`` / ``selection`` / ``sparse``. With
``mask`` given (a saved mask directory) the selection epoch is skipped and
epochs ``[T0, T)`` are sparse. Methods without a selection epoch (``all``,
``last``, ``bitfit``, ``mp``, ``random``) train one trainable set for all
``T`` epochs. ``x_bitfit`` (DP-BiTFiT's two-phase training) runs
``full_epochs = X`` epochs of full DP fine-tuning (phase ``full``), then
DP-BiTFiT on the bias terms (phase ``bias_terms``), with one ledger for both.
"""

from __future__ import annotations

import os
from typing import Mapping

import tensorflow as tf

from sparta_tf import masks, methods
from sparta_tf.groups import row_groups
from sparta_tf.selection.selector import SpartaSelector
from sparta_tf.selection.static import magnitude_selections, random_selections
from sparta_tf.selection.topk import check_density

WARMUP, SELECTION, SPARSE = "warmup", "selection", "sparse"
FULL, BIAS_TERMS = "full", "bias_terms"


class MethodCallback(tf.keras.callbacks.Callback):
    """Runs fine-tuning ``method`` in ``DPModel.fit`` (see module doc).

    Args:
      method: a name from :data:`sparta_tf.methods.METHODS`.
      warmup_epochs: ``T0`` for selection-epoch methods (paper: ``T/5``, 10 of 50).
      density: fraction of rows/entries kept per layer (paper: 0.2).
      score: selection score (``sum_abs`` / ``abs_sum`` for sparta).
      granularity: ``"row"`` or ``"entry"`` (default: the method's).
      density_overrides: ``{layer name pattern: density}``.
      head: classifier head layer or name (default: the layer named "head",
        else the last Dense).
      head_learning_rate_scale: learning-rate multiplier of the head
        (paper's ablation: 0.1 / 0.01 = 10).
      mask_dir: where to save the mask (``mask.npz/json/md``); None: not saved.
      mask: a saved mask (directory or npz) to use instead of selecting one.
      seed: seed of the ``random`` baseline.
      full_epochs: ``X`` of ``x_bitfit`` (epochs of full fine-tuning first).
      bitfit_learning_rate_scale: learning-rate multiplier of the bias phase of
        ``x_bitfit`` (the paper uses 5e-3 after 1e-3: 5).
      verbose: print phase changes and the kept fraction.
    """

    def __init__(
        self,
        method: str,
        *,
        warmup_epochs: int = 0,
        density: float = 0.2,
        score: str | None = None,
        granularity: str | None = None,
        density_overrides: Mapping[str, float] | None = None,
        head=None,
        head_learning_rate_scale: float = 1.0,
        mask_dir: str | None = None,
        mask: str | None = None,
        seed: int = 0,
        full_epochs: int = 1,
        bitfit_learning_rate_scale: float = 5.0,
        verbose: int = 1,
    ):
        super().__init__()
        self.spec = methods.method_spec(method)
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs={warmup_epochs} must be >= 0")
        if warmup_epochs and self.spec.selection != "epoch":
            raise ValueError(f"method {method!r} has no warm-up phase; use warmup_epochs=0")
        self.warmup_epochs = int(warmup_epochs)
        self.density = check_density(density)
        self.score = score or self.spec.score
        self.granularity = granularity or self.spec.granularity
        self.density_overrides = dict(density_overrides or {})
        self.head = head
        self.head_learning_rate_scale = float(head_learning_rate_scale)
        self.mask_dir = mask_dir
        self.mask_path = mask
        self.seed = seed
        if full_epochs < 0:
            raise ValueError(f"full_epochs={full_epochs} must be >= 0")
        self.full_epochs = int(full_epochs)
        self.bitfit_learning_rate_scale = float(bitfit_learning_rate_scale)
        self.verbose = verbose
        self.selector: SpartaSelector | None = None
        self.mask_selections = None
        self.phase: str | None = None

    # ------------------------------------------------------------- planning

    def phase_of(self, epoch: int) -> str:
        """``warmup`` / ``selection`` / ``sparse`` (or the method name when it has one phase)."""
        if self.spec.selection == "two_phase":
            return FULL if epoch < self.full_epochs else BIAS_TERMS
        if self.spec.selection != "epoch":
            return self.spec.name
        if epoch < self.warmup_epochs:
            return WARMUP
        if epoch == self.warmup_epochs and self.mask_path is None:
            return SELECTION
        return SPARSE

    def _check_plan(self, epochs: int) -> None:
        if self.spec.selection == "epoch" and self.mask_path is None and self.warmup_epochs + 1 >= epochs:
            raise ValueError(
                f"warmup_epochs={self.warmup_epochs} leaves no sparse epoch in a fit of {epochs} epochs; "
                f"use warmup_epochs <= {max(epochs - 2, 0)} (paper: T0 = T/5)"
            )

    # ------------------------------------------------------------- phases

    def on_train_begin(self, logs=None):
        from sparta_tf.dp_model import DPModel  # local: dp_model imports nothing from here

        if not isinstance(self.model, DPModel):
            raise TypeError(f"{type(self).__name__} needs a sparta_tf.DPModel; wrap your model with DPModel(...)")
        self._check_plan(self.params.get("epochs", 0))
        if self.mask_path is not None:
            self.mask_selections, _ = masks.load_mask(self.mask_path, self.model.model)
        elif self.spec.selection == "static":
            self.mask_selections = self._static_mask()
            self._save_mask()
        self.phase = None

    def on_epoch_begin(self, epoch, logs=None):
        phase = self.phase_of(epoch)
        if phase == self.phase:
            return
        if phase == SPARSE and self.mask_selections is None:
            self._recover_mask()
        self._enter(phase)

    def on_epoch_end(self, epoch, logs=None):
        if self.phase == SELECTION:
            self.mask_selections = self.selector.select()
            self.model.end_scoring()
            self._save_mask()
            self.phase = None  # the next epoch enters the sparse phase
        if logs is not None:
            logs["trainable_fraction"] = self.model.trainable_set.fraction_of(self.model.model)

    def _enter(self, phase: str) -> None:
        dp = self.model
        if self.model.privacy_callback is not None:
            dp.privacy_callback.phase = phase
        if phase == WARMUP:
            dp.set_trainable_set(methods.warmup_set(dp.model, self.head, self.head_learning_rate_scale))
        elif phase == FULL:
            dp.set_trainable_set(methods.trainable_set(dp.model, "all", None, self.head, self.head_learning_rate_scale))
        elif self.spec.selection == "external":
            pass  # DP-FROST / DP-SSGD: the trainable set was chosen before fit
        elif phase == BIAS_TERMS:
            dp.set_trainable_set(methods.bias_terms_set(dp.model, self.head, self.bitfit_learning_rate_scale))
        elif phase == SELECTION:
            self.selector = SpartaSelector(
                dp.model, self.density, self.score, self.granularity, self.density_overrides, self.head
            )
            if not self.selector.private and dp.ledger is not None:
                dp.ledger.record_nonprivate(f"{self.spec.name}: mask chosen from non-private gradients")
                # epsilon is now infinite: a budget can no longer be enforced, only reported as broken
                dp.ledger.target_epsilon = None
            dp.begin_scoring(self.selector.make_scorer(dp.noise_multiplier, dp.clip_norm))
        else:
            dp.set_trainable_set(methods.trainable_set(
                dp.model, self.spec.name, self.mask_selections, self.head, self.head_learning_rate_scale
            ))
        self.phase = phase
        if self.verbose:
            fraction = dp.trainable_set.fraction_of(dp.model)
            what = "no weight updates" if phase == SELECTION else f"{fraction:.2%} of the parameters trainable"
            print(f"{self.spec.name}: {phase} phase ({what})", flush=True)

    # ------------------------------------------------------------- masks

    def _static_mask(self):
        groups = row_groups(self.model.model, self.head)
        if self.spec.name == "mp":
            return magnitude_selections(groups, self.density, self.granularity, self.density_overrides)
        return random_selections(groups, self.density, self.granularity, self.seed, self.density_overrides)

    def _meta(self) -> dict:
        return {"method": self.spec.name, "score": self.score, "granularity": self.granularity,
                "density": self.density, "private": self.spec.private}

    def _save_mask(self) -> None:
        if self.mask_dir is not None and self.mask_selections is not None:
            masks.save_mask(self.mask_dir, self.mask_selections, self.model.model, **self._meta())

    def _recover_mask(self) -> None:
        """A fit resumed after the selection epoch: reload the mask it saved."""
        saved = None if self.mask_dir is None else os.path.join(self.mask_dir, masks.MASK_FILE)
        if saved is None or not os.path.exists(saved):
            raise ValueError(
                "this fit starts after the selection epoch but no mask is available; "
                "pass mask=<dir of the saved mask> (or the mask_dir of the interrupted run)"
            )
        self.mask_selections, _ = masks.load_mask(saved, self.model.model)


class SpartaCallback(MethodCallback):
    """SPARTA (Makni et al., KDD 2025, Algorithm 1) inside ``DPModel.fit``.

    ``score="sum_abs"`` (paper) or ``"abs_sum"`` (authors' code);
    ``granularity="entry"`` gives the no-grouping ablation. Other arguments as
    :class:`MethodCallback`; ``warmup_epochs`` defaults to the paper's 10 of 50
    epochs, scale it (``T/5``) for shorter runs.
    """

    def __init__(self, *, warmup_epochs: int = 10, density: float = 0.2, score: str = "sum_abs",
                 granularity: str = "row", **kwargs):
        super().__init__("sparta", warmup_epochs=warmup_epochs, density=density, score=score,
                         granularity=granularity, **kwargs)
