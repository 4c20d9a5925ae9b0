"""DP-SSGD's pre-pruning (Algorithm 2 of "Pre-Pruning and Gradient-Dropping Improve Differentially
Private Image Classification").

**1. Pre-pruning** (Algorithm 2) removes a set ``I_pp`` of weights once, before
private training. Pruned weights are set to zero and frozen (they are left
out of the trainable set, so they are never read or written by the optimizer
and stay bit-identical zeros). Three criteria, each returning a boolean
*keep mask* per prunable kernel (``True`` = kept):

* :func:`prune_random` -- in every layer a fraction ``pi_pp`` of the weights,
  uniformly at random. Data-free: no privacy cost.
* :func:`prune_synflow` -- Synflow (Tanaka et al. 2020), data-free and
  iterative. The score of weight ``j`` is Eq. (2)::

      S_SF = dR_SF/dtheta (.) theta,      R_SF = 1^T (prod_l |theta^l|) 1

  i.e. the network is linearised (activations replaced by the identity; for
  ReLU networks with positive weights and inputs this is exact), every
  parameter is replaced by its absolute value, the all-ones input is fed and
  ``R_SF`` is the sum of the outputs. Over ``iterations`` rounds the kept
  density follows the exponential schedule ``(1 - pi_pp)^(k / iterations)``,
  ranking the scores globally over all prunable kernels (Tanaka et al.) and
  re-scoring the masked network each round. No privacy cost.
* :func:`prune_dp_snip` -- DP-SNIP (Algorithm 2, lines 13-22). With
  connection indicators ``c`` (``theta -> c (.) theta``), the per-example
  connection gradient is ``g_{i,j} = dL_i/dc_j |_{c=1} = (dL_i/dtheta_j)
  theta_j``; then (line 17)::

      g~_j = (1/B) [ sum_i clip_{C_p}(g_i)_j + sigma C_p xi_j ],   xi ~ N(0, I)
      s_j  = |g~_j| / sum_k |g~_k|                                 (line 18)

  where ``clip_{C_p}`` clips the per-example vector ``g_i`` (over all prunable
  kernels) to L2 norm ``C_p``. The top ``(1 - pi_pp) m`` connections by ``s_j``
  are kept (global ranking, line 20). One Gaussian mechanism ``M_{q, sigma}``
  of sensitivity ``C_p`` is released, and it is charged to the privacy ledger
  (``kind="dp_snip"``, ``phase="pre-pruning"``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import tensorflow as tf

from sparta_tf import trainable as trainable_lib
from sparta_tf.dp_step.clipping import clipped_sum
from sparta_tf.groups import parameter_table
from sparta_tf.keras_layers import all_layers
from sparta_tf.losses import per_example_loss_fn
from sparta_tf import random_streams
from sparta_tf.dp_step.noise import gaussian_noise
from sparta_tf.dp_step.user_units import user_mean_gradients
from sparta_tf.per_example import make_engine
from sparta_tf.privacy.accounting import check_noise_multiplier, check_sample_rate
from sparta_tf.privacy.user_sampling import UserPoissonSampler
from sparta_tf.trainable import TrainableSet

SNIP_NOISE_STREAM = "dp_snip_noise"
SNIP_USER_STREAM = "dp_snip_users"
SNIP_USER_EXAMPLES_STREAM = "dp_snip_user_examples"
PRUNING_STREAM = "random_pruning"
PRUNE_ROLES = ("kernel", "head")

KeepMasks = list  # list[tuple[tf.Variable, np.ndarray]]: (kernel, boolean keep mask of its shape)


# ------------------------------------------------------------------ helpers


def check_rate(name: str, rate: float) -> float:
    rate = float(rate)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name}={rate!r} must be in [0, 1)")
    return rate


def prunable_variables(model: tf.keras.Model, roles: Sequence[str] = PRUNE_ROLES) -> list[tf.Variable]:
    """Weight tensors pre-pruning acts on: variables of ``roles`` (see
    :func:`sparta_tf.groups.parameter_table`) of rank >= 2 (kernels; biases and
    norms are never pruned)."""
    out = [p.variable for p in parameter_table(model) if p.role in roles and p.variable.shape.rank >= 2]
    if not out:
        raise ValueError(f"the model has no prunable kernels with roles {tuple(roles)}")
    return out


def n_dropped(rate: float, n: int) -> int:
    """``floor(rate n)``, leaving at least one coordinate (no layer collapse)."""
    return min(int(math.floor(rate * n + 1e-9)), n - 1)


def _global_keep(scores: list[np.ndarray], keep: int, alive: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Boolean masks keeping the ``keep`` largest scores over all tensors (ties: lower index)."""
    flat = np.concatenate([s.reshape(-1).astype(np.float64) for s in scores])
    if alive is not None:
        flat = np.where(np.concatenate([a.reshape(-1) for a in alive]), flat, -np.inf)
    order = np.argsort(-flat, kind="stable")[:keep]
    mask = np.zeros(flat.size, dtype=bool)
    mask[order] = True
    out, start = [], 0
    for s in scores:
        out.append(mask[start:start + s.size].reshape(s.shape))
        start += s.size
    return out


def apply_keep_masks(masks: KeepMasks) -> None:
    """Sets the pruned weights (``mask == False``) to exactly zero."""
    for variable, mask in masks:
        variable.assign(tf.where(tf.constant(mask), variable, tf.zeros_like(variable)))


def keep_fraction(masks: KeepMasks) -> float:
    """Kept weights / prunable weights."""
    return sum(int(m.sum()) for _, m in masks) / sum(m.size for _, m in masks)


# ------------------------------------------------------------- pre-pruning


def prune_random(
    model: tf.keras.Model, rate: float, *, seed: int | None = None,
    roles: Sequence[str] = PRUNE_ROLES, apply: bool = True,
) -> KeepMasks:
    """Random pre-pruning: in each prunable kernel, ``floor(rate n)`` of its ``n``
    weights, uniformly at random, are pruned. Data-free (no privacy cost);
    drawn from the ``"random_pruning"`` stream of ``seed`` (the DP model's public seed: the pruned
    weights can be read off a release; None: a fresh one).

    Returns ``[(kernel, keep_mask)]``; with ``apply`` the pruned weights are zeroed.
    """
    rate = check_rate("rate", rate)
    rng = random_streams.numpy_rng(random_streams.resolve_seed(seed), PRUNING_STREAM)
    masks = []
    for variable in prunable_variables(model, roles):
        n = int(np.prod(variable.shape.as_list()))
        mask = np.ones(n, dtype=bool)
        mask[rng.choice(n, size=n_dropped(rate, n), replace=False)] = False
        masks.append((variable, mask.reshape(variable.shape.as_list())))
    if apply:
        apply_keep_masks(masks)
    return masks


def _input_ones(model: tf.keras.Model, input_shape) -> tf.Tensor:
    if input_shape is None:
        inputs = getattr(model, "inputs", None)
        if not inputs:
            raise ValueError("the model has no symbolic inputs: pass input_shape=(features...) (without batch)")
        if len(inputs) > 1:
            raise ValueError("Synflow supports single-input models")
        input_shape = inputs[0].shape[1:]
    shape = [1] + [int(d) for d in input_shape]
    return tf.ones(shape, tf.float32)


def _linearised(model: tf.keras.Model):
    """Layers with an ``activation`` attribute and their current activations."""
    saved = []
    for layer in all_layers(model):
        if hasattr(layer, "activation") and callable(layer.activation):
            saved.append((layer, layer.activation))
    return saved


def prune_synflow(
    model: tf.keras.Model, rate: float, iterations: int = 100, *,
    input_shape: Sequence[int] | None = None, roles: Sequence[str] = PRUNE_ROLES, apply: bool = True,
) -> KeepMasks:
    """Synflow pre-pruning (data-free, iterative; Eq. (2) of the paper).

    Round ``k = 1..iterations``: with every trainable parameter replaced by
    ``|theta| (.) mask``, activations by the identity, and the all-ones input
    ``1`` (shape from ``model.inputs`` or ``input_shape``), compute
    ``R_SF = sum(f(1))`` and the scores ``S = dR_SF/dtheta (.) |theta|``, then
    keep the ``(1 - rate)^(k/iterations) m`` highest-scoring of the ``m``
    prunable weights (globally; pruned weights stay pruned). The model's
    weights and activations are restored afterwards, then (``apply``) the
    pruned weights are zeroed. Touches no data: no privacy cost.

    Caveats: layers whose nonlinearity is not an ``activation`` attribute
    (e.g. a separate ``Softmax`` layer) are not linearised; scores are float32.
    """
    rate = check_rate("rate", rate)
    if int(iterations) < 1:
        raise ValueError(f"iterations={iterations!r} must be >= 1")
    iterations = int(iterations)
    prunable = prunable_variables(model, roles)
    ones = _input_ones(model, input_shape)
    params = list(model.trainable_variables)
    originals = [v.numpy() for v in params]
    m = sum(int(np.prod(v.shape.as_list())) for v in prunable)
    keep = [np.ones(v.shape.as_list(), dtype=bool) for v in prunable]
    prunable_ids = {id(v): k for k, v in enumerate(prunable)}
    activations = _linearised(model)
    try:
        for layer, _ in activations:
            layer.activation = tf.keras.activations.linear
        for k in range(1, iterations + 1):
            for v, w in zip(params, originals):
                j = prunable_ids.get(id(v))
                v.assign(np.abs(w) * (keep[j] if j is not None else 1.0))
            with tf.GradientTape() as tape:
                r = tf.reduce_sum(tf.cast(model(ones, training=False), tf.float32))
            grads = tape.gradient(r, prunable)
            scores = [
                np.zeros(v.shape.as_list(), np.float32) if g is None
                else np.abs(tf.convert_to_tensor(g).numpy() * v.numpy())
                for g, v in zip(grads, prunable)
            ]
            n_keep = max(1, int(round(m * (1.0 - rate) ** (k / iterations))))
            keep = _global_keep(scores, n_keep, alive=keep)
    finally:
        for layer, activation in activations:
            layer.activation = activation
        for v, w in zip(params, originals):
            v.assign(w)
    masks = list(zip(prunable, keep))
    if apply:
        apply_keep_masks(masks)
    return masks


def prune_dp_snip(
    model: tf.keras.Model, x, y, loss, rate: float, noise_multiplier: float, clip_norm: float,
    sample_rate: float, ledger, *, batch_size: int = 256, seed: int | None = None,
    roles: Sequence[str] = PRUNE_ROLES, engine: str = "auto", apply: bool = True,
    users=None, examples_per_user: int | None = None,
) -> KeepMasks:
    """DP-SNIP pre-pruning (Algorithm 2, DP-SNIP), one Gaussian mechanism.

    ``x, y``: the private examples used (a Poisson sample of rate
    ``sample_rate`` of the dataset, or the whole dataset with ``sample_rate=1``).
    Per unit ``i`` the connection gradients ``g_{i,j} = (dL_i/dtheta_j)
    theta_j`` over all prunable kernels are clipped jointly to L2 norm
    ``clip_norm`` (:func:`clipped_connection_sums`); the sum gets
    ``N(0, noise_multiplier^2 clip_norm^2 I)`` and is divided by the number of
    units; ``s_j = |g~_j| / sum_k |g~_k|`` and the top ``(1 - rate) m``
    connections are kept. A unit is an example, or with ``users`` (one id per
    example; user-level DP) a user: the mean of at most ``examples_per_user``
    of its connection gradients, clipped once, so that one user, whatever its
    number of examples, moves the sum by at most ``clip_norm``.
    ``ledger.record(noise_multiplier, sample_rate, 1, kind="dp_snip",
    phase="pre-pruning")`` charges the release (a ``PrivacyLedger``, e.g. the
    training model's ``dp.ledger``, so that ``epsilon = epsilon_pp +
    epsilon_gd`` composes). ``batch_size`` only bounds memory (examples, or
    users, processed at once).
    """
    rate = check_rate("rate", rate)
    noise_multiplier = check_noise_multiplier(noise_multiplier)
    if noise_multiplier <= 0:
        raise ValueError("DP-SNIP needs noise_multiplier > 0")
    sample_rate = check_sample_rate(sample_rate)
    if ledger is None:
        raise ValueError("DP-SNIP releases a noisy statistic of the data: pass the PrivacyLedger to charge")
    prunable = prunable_variables(model, roles)
    seed = random_streams.resolve_seed(seed)
    sums, units = clipped_connection_sums(model, x, y, loss, prunable, clip_norm, batch_size=batch_size,
                                          engine=engine, users=users, examples_per_user=examples_per_user,
                                          seed=seed)
    noise = gaussian_noise([s.shape for s in sums], noise_multiplier * clip_norm,
                           tf.constant(seed, tf.int64), tf.constant(0, tf.int64), stream=SNIP_NOISE_STREAM)
    noisy = [((s + z) / units).numpy() for s, z in zip(sums, noise)]
    ledger.record(noise_multiplier, sample_rate, 1, kind="dp_snip", phase="pre-pruning")
    total = sum(float(np.abs(g).sum()) for g in noisy) or 1.0
    scores = [np.abs(g) / total for g in noisy]
    m = sum(s.size for s in scores)
    masks = list(zip(prunable, _global_keep(scores, max(1, m - int(math.floor(rate * m + 1e-9))))))
    if apply:
        apply_keep_masks(masks)
    return masks


def clipped_connection_sums(model: tf.keras.Model, x, y, loss, prunable: Sequence[tf.Variable], clip_norm: float, *,
                            batch_size: int = 256, engine: str = "auto", users=None,
                            examples_per_user: int | None = None, seed: int = 0) -> tuple[list[tf.Tensor], int]:
    """DP-SNIP's statistic before its noise: ``sum_i clip(g_i)`` over the units, with the number of units.

    A unit is an example (``users`` None), or a user (``users``: one id per example): its connection
    gradients averaged over at most ``examples_per_user`` of its examples (the ones with the smallest keys of
    the secret ``"dp_snip_user_examples"`` stream, :class:`~sparta_tf.privacy.user_sampling.UserPoissonSampler`
    at rate 1), then clipped once (:func:`~sparta_tf.dp_step.user_units.user_mean_gradients`)."""
    if not clip_norm > 0:
        raise ValueError(f"clip_norm={clip_norm!r} must be > 0")
    loss_fn = per_example_loss_fn(loss)
    run = make_engine(model, [trainable_lib.dense(v) for v in prunable], engine, materialise=True)
    n = len(tf.nest.flatten(x)[0])
    if n == 0:
        raise ValueError("DP-SNIP got no examples")
    values = [tf.convert_to_tensor(v)[None] for v in prunable]
    sums = [tf.zeros(v.shape, tf.float32) for v in prunable]
    if users is None:
        for start in range(0, n, batch_size):
            xb, yb = tf.nest.map_structure(lambda t: t[start:start + batch_size], (x, y))
            result = run(xb, yb, loss_fn, tf.ones([len(tf.nest.flatten(xb)[0])], tf.bool))
            batch_sums, _ = clipped_sum([g * v for g, v in zip(result.grads, values)], clip_norm, result.valid)
            sums = [total + part for total, part in zip(sums, batch_sums)]
        return sums, n
    if examples_per_user is None:
        raise ValueError("DP-SNIP over users needs examples_per_user (the most examples of one user it takes)")
    sampler = UserPoissonSampler(users, 1.0, examples_per_user, units_per_batch=max(1, batch_size // examples_per_user),
                                 seed=seed, stream=SNIP_USER_STREAM, examples_stream=SNIP_USER_EXAMPLES_STREAM)
    for chunk, chunk_weights in sampler.row_batches(0):
        xb, yb = tf.nest.map_structure(lambda t: tf.gather(t, chunk), (x, y))
        result = run(xb, yb, loss_fn, tf.constant(chunk_weights > 0))
        means, usable = user_mean_gradients([g * v for g, v in zip(result.grads, values)], chunk_weights,
                                            result.valid, sampler.examples_per_user)
        batch_sums, _ = clipped_sum(means, clip_norm, usable)
        sums = [total + part for total, part in zip(sums, batch_sums)]
    return sums, sampler.users


def ssgd_trainable_set(model: tf.keras.Model, masks: KeepMasks) -> TrainableSet:
    """The pre-pruned trainable set: kept entries of each masked kernel plus
    every other trainable variable of ``model`` whole (biases, norms, head...).
    Pruned coordinates are outside it, hence frozen."""
    by_id = {id(v): m for v, m in masks}
    selections = []
    for v in model.trainable_variables:
        mask = by_id.get(id(v))
        selections.append(trainable_lib.dense(v) if mask is None else trainable_lib.entries(v, mask))
    return TrainableSet(selections)
