"""DP-SSGD: pre-pruning and gradient dropping for DP-SGD.

Implements "Pre-Pruning and Gradient-Dropping Improve Differentially Private
Image Classification" (DP-SSGD, Algorithm 1 of the paper) on top of
:class:`~sparta_tf.dp_model.DPModel`.

The package, a module per concept:

* :mod:`sparta_tf.ssgd.pruning`: **pre-pruning** (Algorithm 2) once before private training:
  :func:`prune_random`, :func:`prune_synflow` (data-free) and :func:`prune_dp_snip` (one
  Gaussian mechanism, charged to the ledger); :func:`ssgd_trainable_set` trains the kept weights;
* :mod:`sparta_tf.ssgd.dropping`: **gradient dropping** (Algorithm 3) at every step, a gradient
  filter of the DP step (:class:`GradientDropping`);
* :mod:`sparta_tf.ssgd.model`: :class:`SSGDModel`, a DPModel with the two plugged in.
"""

from sparta_tf.ssgd.dropping import DROP_MODES, DROP_STREAM, GradientDropping
from sparta_tf.ssgd.model import SSGDModel
from sparta_tf.ssgd.pruning import (
    PRUNE_ROLES,
    PRUNING_STREAM,
    SNIP_NOISE_STREAM,
    KeepMasks,
    apply_keep_masks,
    keep_fraction,
    prunable_variables,
    prune_dp_snip,
    prune_random,
    prune_synflow,
    ssgd_trainable_set,
)

__all__ = [
    "DROP_MODES",
    "DROP_STREAM",
    "GradientDropping",
    "KeepMasks",
    "PRUNE_ROLES",
    "PRUNING_STREAM",
    "SNIP_NOISE_STREAM",
    "SSGDModel",
    "apply_keep_masks",
    "keep_fraction",
    "prunable_variables",
    "prune_dp_snip",
    "prune_random",
    "prune_synflow",
    "ssgd_trainable_set",
]
