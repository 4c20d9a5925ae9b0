"""DP-FROST's partitions and its partition-wise gradient magnitudes (PGMs): steps 1-2 of
:mod:`sparta_tf.selection.frost`.

**Partitions.** ``S = {P_1, ..., P_M}``: every layer's trainable variables form one partition
(a weight matrix with its bias vector; a norm layer's scale with its offset).

**PGMs** (Definitions 7-8), for a set ``R`` of partitions, norm order ``alpha in {1, 2}``, clip
``c`` and ``c_bar = c / (sum_{P in R} |P| / |R|)^(1/alpha)``::

  DP-MG   mu^c_{R,P}(X) = || [sum_x C_c^alpha(g_R(x))]_P ||_alpha / |P|^(1/alpha)
  DP-MGN  mu^n_{R,P}(X) = || [sum_x C_cbar^alpha(gbar_R(x))]_P ||_alpha
  DP-MGNA mu^a_{R,P}(X) = || [sum_x C_cbar^alpha(abs(gbar_R(x)))]_P ||_alpha

with ``C_k^alpha(g) = g * min(1, k / ||g||_alpha)`` and ``gbar_R(x) = concat_P g_P(x) /
|P|^(1/alpha)``; their L2 sensitivities (Lemma 3) are ``c / (min_{P in R} |P|)^(1/alpha)`` (DP-MG)
and ``c_bar`` (DP-MGN, DP-MGNA), and the mechanism releases ``mu_R(X) + N(0, sigma^2 Delta^2 I)``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import tensorflow as tf

from sparta_tf import method_spec
from sparta_tf.dp_step.clipping import clipped_sum
from sparta_tf.groups import parameter_table

METHODS = method_spec.FROST_MAGNITUDES
"""The magnitudes: ``mg``, ``mgn``, ``mgna``."""

_OPTIONS = method_spec.SPECS["dp_frost"].defaults()
DEFAULT_METHOD = _OPTIONS["frost_magnitude"]
DEFAULT_ALPHA = _OPTIONS["frost_alpha"]


# --------------------------------------------------------------------------
# Partitions.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Partition:
    """One partition ``P``: the trainable variables of one layer (kernel + bias)."""

    name: str
    variables: tuple

    @property
    def size(self) -> int:
        return int(sum(int(np.prod(v.shape.as_list())) for v in self.variables))


def partitions(model: tf.keras.Model) -> list[Partition]:
    """Disjoint partitions of the model's trainable variables, one per layer (in layer order)."""
    order, by_layer = [], {}
    for info in parameter_table(model):
        if info.layer not in by_layer:
            by_layer[info.layer] = []
            order.append(info.layer)
        by_layer[info.layer].append(info.variable)
    return [Partition(name, tuple(by_layer[name])) for name in order]


# --------------------------------------------------------------------------
# Partition magnitude mechanisms (Definitions 7-8, Lemma 3).
# --------------------------------------------------------------------------


def check_magnitude(method: str, alpha: int) -> None:
    """A one-line ValueError unless ``method`` is one of :data:`METHODS` and ``alpha`` is 1 or 2."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    if alpha not in (1, 2):
        raise ValueError(f"alpha must be 1 or 2, got {alpha!r}")


def pgm_sensitivity(sizes: Sequence[int], method: str, alpha: int, clip: float) -> float:
    """Lemma 3: ``c / min|P|^(1/alpha)`` (DP-MG) or ``c_bar = c / mean|P|^(1/alpha)`` (DP-MGN/A)."""
    check_magnitude(method, alpha)
    sizes = np.asarray(sizes, dtype=np.float64)
    if method == "mg":
        return float(clip / sizes.min() ** (1.0 / alpha))
    return float(clip / sizes.mean() ** (1.0 / alpha))


def clipped_partition_sums(
    grads: Sequence[np.ndarray], method: str, alpha: int, clip: float
) -> list[np.ndarray]:
    """``[sum_x C_k^alpha(h(x))]_P`` for every partition ``P`` of ``R``.

    ``grads[i]``: per-example gradients of partition ``P_i in R``, ``[B, |P_i|]``.
    ``h = g_R`` and ``k = c`` for DP-MG; ``h = gbar_R`` (each block divided by
    ``|P|^(1/alpha)``), ``k = c_bar`` for DP-MGN, plus ``abs`` for DP-MGNA.
    Clipping uses the alpha-norm over the concatenation over all of ``R``.
    """
    check_magnitude(method, alpha)
    sizes = [g.shape[1] for g in grads]
    blocks = [tf.convert_to_tensor(np.asarray(g), tf.float64) for g in grads]
    if method == "mg":
        bound = float(clip)
    else:
        blocks = [b / n ** (1.0 / alpha) for b, n in zip(blocks, sizes)]
        if method == "mgna":
            blocks = [tf.abs(b) for b in blocks]
        bound = pgm_sensitivity(sizes, method, alpha, clip)  # c_bar
    # The DP step's clipped sum, in the alpha-norm over the concatenation of R.
    valid = tf.ones([int(blocks[0].shape[0])], tf.bool)
    sums, _ = clipped_sum(blocks, bound, valid, order=alpha)
    return [s.numpy() for s in sums]


def magnitudes_from_sums(sums: Sequence[np.ndarray], method: str, alpha: int) -> np.ndarray:
    """``mu_{R,P} = ||sum_P||_alpha`` (divided by ``|P|^(1/alpha)`` for DP-MG only)."""
    check_magnitude(method, alpha)
    mu = np.array([np.sum(np.abs(s) ** alpha) ** (1.0 / alpha) for s in sums])
    if method == "mg":
        mu = mu / np.array([s.size for s in sums], np.float64) ** (1.0 / alpha)
    return mu


def partition_magnitudes(
    grads: Sequence[np.ndarray], method: str = DEFAULT_METHOD, alpha: int = DEFAULT_ALPHA, clip: float = 1.0
) -> tuple[np.ndarray, float]:
    """Exact (non-private) ``mu_R(X)`` of Definition 8 and its sensitivity (Lemma 3)."""
    sums = clipped_partition_sums(grads, method, alpha, clip)
    return magnitudes_from_sums(sums, method, alpha), pgm_sensitivity([g.shape[1] for g in grads], method, alpha, clip)


def noisy_partition_magnitudes(
    grads: Sequence[np.ndarray],
    noise_multiplier: float,
    rng: np.random.Generator,
    method: str = DEFAULT_METHOD,
    alpha: int = DEFAULT_ALPHA,
    clip: float = 1.0,
) -> tuple[np.ndarray, float]:
    """DP-MG / DP-MGN / DP-MGNA: ``mu_R(X) + N(0, sigma^2 Delta^2 I)``; returns (noisy mu, Delta)."""
    mu, delta = partition_magnitudes(grads, method, alpha, clip)
    return mu + rng.normal(0.0, noise_multiplier * delta, size=mu.shape), delta
