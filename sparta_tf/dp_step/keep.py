"""The gradient filter of a DP step ("mask or drop"): which coordinates ``I_s`` step ``t`` trains.

The trainable set (:mod:`sparta_tf.trainable`) already restricts every quantity of a step to its
coordinates ``I`` (compact form: a mask is the set itself). A gradient filter may restrict step
``t`` further to ``I_s(t) ⊆ I``; then, with ``1_s`` the indicator of ``I_s``::

    g_i    <- 1_s (.) g_i          before the norm and clipping (the clipped sum has sensitivity C)
    g~_t   <- 1_s (.) g~_t         the noisy gradient: no noise outside I_s
    theta[I \\ I_s], optimizer state[I \\ I_s]  unchanged

:data:`KEEP_ALL` is the identity (``I_s = I``, and the step needs no per-example gradients for
it); DP-SSGD's :class:`~sparta_tf.ssgd.dropping.GradientDropping` is the other filter. A filter
holds configuration only: ``keep_masks`` returns the masks of a step as a value, which the step
passes on to the clipping, the release and the optimizer.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import tensorflow as tf

from sparta_tf.trainable import TrainableSet

KeepMasks = list  # list[tf.Tensor]: one boolean tensor per selection, in its compact shape (True: in I_s)


class GradientFilter(Protocol):
    """What a step asks of a gradient filter (see the module doc)."""

    needs_per_example_gradients: bool
    """True when the filter acts on ``g_i`` themselves (a materialising engine)."""

    def keep_masks(self, trainable_set: TrainableSet, step: tf.Tensor) -> KeepMasks | None:
        """``1_s`` of step ``step``, one boolean tensor per selection; None: ``I_s = I``."""


class KeepAll:
    """The identity filter: ``I_s = I`` at every step."""

    needs_per_example_gradients = False

    def keep_masks(self, trainable_set: TrainableSet, step: tf.Tensor) -> None:
        return None


KEEP_ALL = KeepAll()


def restrict(tensors: Sequence[tf.Tensor], keep: KeepMasks, batch_dims: int = 0) -> list[tf.Tensor]:
    """``1_s (.) t`` for each tensor (zeros outside ``I_s``); ``batch_dims=1`` for per-example ``[B, ...]``."""
    masks = [k[(None,) * batch_dims] if batch_dims else k for k in keep]
    return [tf.where(m, t, tf.zeros_like(t)) for t, m in zip(tensors, masks)]
