"""``SSGDModel``: a :class:`~sparta_tf.DPModel` with DP-SSGD's parts plugged in.

DP-SSGD (Algorithm 1) is DP-SGD on a pre-pruned trainable set
(:func:`~sparta_tf.ssgd.pruning.ssgd_trainable_set`) with gradient dropping at every step
(:class:`~sparta_tf.ssgd.dropping.GradientDropping`, the step's gradient filter). The class
only wires the two into a DPModel (``set_trainable_set``, ``set_gradient_filter``); the step is
DPModel's.

Typical use::

    dp = SSGDModel(model, noise_multiplier=1.0, sample_rate=q, delta=1e-5,
                   drop_rate=0.5, drop_mode="random")
    masks = prune_synflow(model, rate=0.8, iterations=100)          # or prune_random
    # masks = prune_dp_snip(model, x, y, loss, 0.8, noise_multiplier=2.0,
    #                       clip_norm=1.0, sample_rate=1.0, ledger=dp.ledger)
    dp.set_keep_masks(masks)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=...)
    dp.fit(x, y, epochs=...)
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from sparta_tf.dp_model import DPModel
from sparta_tf.ssgd.dropping import GradientDropping
from sparta_tf.ssgd.pruning import KeepMasks, ssgd_trainable_set
from sparta_tf.trainable import VariableSelection


class SSGDModel(DPModel):
    """DP-SSGD (Algorithm 1): DP-SGD on a pre-pruned trainable set with gradient dropping at
    every step (see :mod:`sparta_tf.ssgd`).

    Args (besides those of :class:`DPModel`):
      keep_masks: pre-pruning masks ``[(kernel, keep_mask)]`` from a ``prune_*`` function
        (``None``: no pre-pruning); sets the trainable set to :func:`ssgd_trainable_set`. Also
        settable later with :meth:`set_keep_masks`.
      drop_rate: ``pi_gd`` in ``[0, 1)``; per trainable tensor with ``|I|`` trainable
        coordinates, ``floor(pi_gd |I|)`` are dropped each step (at least one is kept). ``0`` is
        plain DP-SGD.
      drop_mode: ``"random"`` or ``"magnitude"`` (drop the smallest ``|theta|``).
      drop_seed: seed of the ``"gradient_dropping"`` stream; default: the run's public seed
        (:attr:`DPModel.public_seed`).
      drop_filter: optional predicate on a :class:`~sparta_tf.trainable.VariableSelection`;
        tensors for which it is False are never dropped from.
    """

    def __init__(
        self, model: tf.keras.Model, *, keep_masks: KeepMasks | None = None, drop_rate: float = 0.0,
        drop_mode: str = "random", drop_seed: int | None = None,
        drop_filter: Callable[[VariableSelection], bool] | None = None, **kwargs,
    ):
        super().__init__(model, **kwargs)
        self.dropping = GradientDropping(drop_rate, drop_mode, self.public_seed if drop_seed is None else drop_seed,
                                         applies_to=drop_filter)
        self.set_gradient_filter(self.dropping)
        self.keep_masks_pp = None
        if keep_masks is not None:
            self.set_keep_masks(keep_masks)

    @property
    def drop_rate(self) -> float:
        return self.dropping.rate

    @property
    def drop_mode(self) -> str:
        return self.dropping.mode

    def set_keep_masks(self, masks: KeepMasks) -> None:
        """Pre-pruning: trains only the kept entries of the masked kernels (and every other
        trainable variable). Zero the pruned weights first (the ``prune_*`` functions do by default)."""
        self.keep_masks_pp = masks
        self.set_trainable_set(ssgd_trainable_set(self.model, masks))

    def keep_masks_for_step(self, step) -> list[tf.Tensor]:
        """``I_s`` of DP step ``step`` over the current trainable set
        (:meth:`GradientDropping.masks_for_step`; all True at ``drop_rate=0``)."""
        return self.dropping.masks_for_step(self.trainable_set, step)
