"""DP-SSGD: pre-pruning and gradient dropping for DP-SGD.

Implements "Pre-Pruning and Gradient-Dropping Improve Differentially Private
Image Classification" (DP-SSGD, Algorithm 1 of the paper) on top of
:class:`~sparta_tf.dp_model.DPModel`.

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

**2. Gradient dropping** (Algorithm 3, Sec. 3.2) at *every* step ``t``: for
each trainable tensor (the kept coordinates ``I`` of a pre-pruned kernel, or
a whole bias / norm / head tensor) a set ``I_ns`` of ``floor(pi_gd |I|)``
coordinates is dropped and ``I_s = I \\ I_ns`` is kept:

* ``"random"``: ``I_ns`` uniformly at random (stateless Philox keyed by the
  ``"gradient_dropping"`` stream of :mod:`sparta_tf.random_streams` at step
  ``t`` and the tensor, so every step draws a fresh set);
* ``"magnitude"``: ``I_ns`` = the ``floor(pi_gd |I|)`` coordinates with the
  smallest ``|theta^(t)|``. The weights are already DP, so by post-processing
  this costs no privacy.

Only ``I_s`` is clipped, noised and updated, Eqs. (3)-(5)::

    grad^C[I_s, b] = grad[I_s, b] / max(1, ||grad[I_s, b]||_2 / C)              (3)
    theta^(t+1)[I_s]  = theta^(t)[I_s] - eta/(qn) [ sum_b grad^C[I_s, b] + sigma C zeta ]   (4)
    theta^(t+1)[I_ns] = theta^(t)[I_ns]                                          (5)

:class:`SSGDModel` does this in-graph (no retracing): per-example gradients
(compact over the pre-pruned trainable set) are zeroed outside ``I_s``
*before* norms and clipping, the noise is zeroed outside ``I_s``, and the
optimizer (:class:`DroppingOptimizer`) neither moves dropped weights nor
their optimizer state (momentum / Adam moments), so Eq. (5) holds exactly
also with momentum. The sensitivity of the clipped sum is still ``C``, so
the privacy cost per step is that of ordinary DP-SGD ``M_{q, sigma}``.

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

import math
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from sparta_tf import trainable as trainable_lib
from sparta_tf.backend import tf_variable
from sparta_tf.clipping import clipped_sum
from sparta_tf.dp_model import DPModel
from sparta_tf.groups import parameter_table
from sparta_tf.losses import per_example_loss_fn
from sparta_tf import method_spec, random_streams
from sparta_tf.noise import gaussian_noise
from sparta_tf.optim.masked_optimizer import MaskedOptimizer, _element_indices
from sparta_tf.per_example import make_engine
from sparta_tf.privacy.accounting import check_noise_multiplier, check_sample_rate
from sparta_tf.trainable import TrainableSet, VariableSelection

DROP_STREAM = "gradient_dropping"
SNIP_NOISE_STREAM = "dp_snip_noise"
PRUNING_STREAM = "random_pruning"
PRUNE_ROLES = ("kernel", "head")
DROP_MODES = method_spec.DROP_MODES

KeepMasks = list  # list[tuple[tf.Variable, np.ndarray]]: (kernel, boolean keep mask of its shape)


# ------------------------------------------------------------------ helpers


def _check_rate(name: str, rate: float) -> float:
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


def _n_drop(rate: float, n: int) -> int:
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
    drawn from the ``"random_pruning"`` stream of the run ``seed``.

    Returns ``[(kernel, keep_mask)]``; with ``apply`` the pruned weights are zeroed.
    """
    rate = _check_rate("rate", rate)
    rng = random_streams.numpy_rng(random_streams.resolve_seed(seed), PRUNING_STREAM)
    masks = []
    for variable in prunable_variables(model, roles):
        n = int(np.prod(variable.shape.as_list()))
        mask = np.ones(n, dtype=bool)
        mask[rng.choice(n, size=_n_drop(rate, n), replace=False)] = False
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
    for layer in model.submodules:
        if isinstance(layer, tf.keras.layers.Layer) and hasattr(layer, "activation") and callable(layer.activation):
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
    rate = _check_rate("rate", rate)
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
) -> KeepMasks:
    """DP-SNIP pre-pruning (Algorithm 2, DP-SNIP), one Gaussian mechanism.

    ``x, y``: the private examples used (a Poisson sample of rate
    ``sample_rate`` of the dataset, or the whole dataset with ``sample_rate=1``).
    Per example ``i`` the connection gradients ``g_{i,j} = (dL_i/dtheta_j)
    theta_j`` over all prunable kernels are clipped jointly to L2 norm
    ``clip_norm``; the sum gets ``N(0, noise_multiplier^2 clip_norm^2 I)``
    and is divided by ``B``; ``s_j = |g~_j| / sum_k |g~_k|`` and the top
    ``(1 - rate) m`` connections are kept. ``ledger.record(noise_multiplier,
    sample_rate, 1, kind="dp_snip", phase="pre-pruning")`` charges the release
    (a ``PrivacyLedger``, e.g. the training model's ``dp.ledger``, so that
    ``epsilon = epsilon_pp + epsilon_gd`` composes). ``batch_size`` only
    bounds memory (examples processed at once).
    """
    rate = _check_rate("rate", rate)
    noise_multiplier = check_noise_multiplier(noise_multiplier)
    if noise_multiplier <= 0:
        raise ValueError("DP-SNIP needs noise_multiplier > 0")
    sample_rate = check_sample_rate(sample_rate)
    if not clip_norm > 0:
        raise ValueError(f"clip_norm={clip_norm!r} must be > 0")
    if ledger is None:
        raise ValueError("DP-SNIP releases a noisy statistic of the data: pass the PrivacyLedger to charge")
    prunable = prunable_variables(model, roles)
    loss_fn = per_example_loss_fn(loss)
    run = make_engine(model, [trainable_lib.dense(v) for v in prunable], engine)
    n = len(tf.nest.flatten(x)[0])
    if n == 0:
        raise ValueError("DP-SNIP got no examples")
    sums = [tf.zeros(v.shape, tf.float32) for v in prunable]
    for start in range(0, n, batch_size):
        xb, yb = tf.nest.map_structure(lambda t: t[start:start + batch_size], (x, y))
        valid = tf.ones([len(tf.nest.flatten(xb)[0])], tf.bool)
        result = run(xb, yb, loss_fn, valid)
        connection_grads = [g * tf.convert_to_tensor(v)[None] for g, v in zip(result.grads, prunable)]
        batch_sums, _ = clipped_sum(connection_grads, clip_norm, result.valid)
        sums = [total + part for total, part in zip(sums, batch_sums)]
    noise = gaussian_noise([s.shape for s in sums], noise_multiplier * clip_norm,
                           tf.constant(random_streams.resolve_seed(seed), tf.int64), tf.constant(0, tf.int64),
                           stream=SNIP_NOISE_STREAM)
    noisy = [((s + z) / n).numpy() for s, z in zip(sums, noise)]
    ledger.record(noise_multiplier, sample_rate, 1, kind="dp_snip", phase="pre-pruning")
    total = sum(float(np.abs(g).sum()) for g in noisy) or 1.0
    scores = [np.abs(g) / total for g in noisy]
    m = sum(s.size for s in scores)
    masks = list(zip(prunable, _global_keep(scores, max(1, m - int(math.floor(rate * m + 1e-9))))))
    if apply:
        apply_keep_masks(masks)
    return masks


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


# -------------------------------------------------------- gradient dropping


class DroppingOptimizer(MaskedOptimizer):
    """:class:`MaskedOptimizer` whose update touches only the kept coordinates
    ``I_s`` of the step: the decrement and the optimizer state (momentum, Adam
    moments) of dropped coordinates are left exactly as they were (Eq. (5)).

    ``keep_masks`` (one boolean tensor of compact shape per selection) must be
    set before :meth:`apply`; ``None`` means an ordinary masked update.
    """

    keep_masks: list | None = None

    def apply(self, grads):
        if self.keep_masks is None:
            return super().apply(grads)
        if len(grads) != len(self._selections):
            raise ValueError(f"{len(grads)} gradients for {len(self._selections)} selections; call build() first")
        masks = list(self.keep_masks)
        context = tf.distribute.get_replica_context()
        if context is None:
            self._apply_dropped(tf.distribute.get_strategy(), grads, masks)
        else:
            context.merge_call(self._apply_dropped, args=(grads, masks))

    def _apply_dropped(self, strategy, grads, masks):
        lr = self.learning_rate()
        step = tf.cast(self.keras_optimizer.iterations + 1, tf.float32)
        for selection, key, grad, keep in zip(self._selections, self._keys, grads, masks):
            slots = self.slots[key]
            strategy.extended.update(
                tf_variable(selection.variable), self._dropped_update_fn(selection),
                args=(grad, keep, lr * selection.learning_rate_scale, step, *slots), group=False,
            )
        self.keras_optimizer.iterations.assign_add(1)

    def _dropped_update_fn(self, selection: VariableSelection):
        element_indices = _element_indices(selection)

        def update(variable, grad, keep, lr, step, *slots):
            grad = tf.convert_to_tensor(grad)
            keep = tf.convert_to_tensor(keep)
            before = [tf.identity(s.read_value()) for s in slots]
            decrement = self._decrement(grad, lr, step, slots)
            weight_decay = getattr(self.keras_optimizer, "weight_decay", None)
            if weight_decay:
                current = variable if element_indices is None else tf.gather_nd(variable, element_indices)
                decrement += lr * weight_decay * tf.reshape(current, tf.shape(decrement))
            decrement = tf.where(keep, decrement, tf.zeros_like(decrement))
            for slot, old in zip(slots, before):
                slot.assign(tf.where(keep, slot.read_value(), old))
            if element_indices is None:
                return variable.assign_sub(decrement)
            return variable.scatter_nd_sub(element_indices, tf.reshape(decrement, [-1]))

        return update


class SSGDModel(DPModel):
    """DP-SSGD (Algorithm 1): DP-SGD on a pre-pruned trainable set with
    gradient dropping at every step (see the module doc for the math).

    Args (besides those of :class:`DPModel`):
      keep_masks: pre-pruning masks ``[(kernel, keep_mask)]`` from a
        ``prune_*`` function (``None``: no pre-pruning); sets the trainable set
        to :func:`ssgd_trainable_set`. Also settable later with
        :meth:`set_keep_masks`.
      drop_rate: ``pi_gd`` in ``[0, 1)``; per trainable tensor with ``|I|``
        trainable coordinates, ``floor(pi_gd |I|)`` are dropped each step (at
        least one is kept). ``0`` is plain DP-SGD.
      drop_mode: ``"random"`` or ``"magnitude"`` (drop the smallest ``|theta|``).
      drop_seed: seed of the ``"gradient_dropping"`` stream; default: the run
        seed (:attr:`DPModel.seed`). Dropping is data-independent, so this
        stream need not be secret.
      drop_filter: optional predicate on a
        :class:`~sparta_tf.trainable.VariableSelection`; tensors for which it is
        False are never dropped from (default: dropping applies to all, as in
        the paper, "at every layer").
    """

    def __init__(
        self, model: tf.keras.Model, *, keep_masks: KeepMasks | None = None, drop_rate: float = 0.0,
        drop_mode: str = "random", drop_seed: int | None = None,
        drop_filter: Callable[[VariableSelection], bool] | None = None, **kwargs,
    ):
        super().__init__(model, **kwargs)
        self.drop_rate = _check_rate("drop_rate", drop_rate)
        if drop_mode not in DROP_MODES:
            raise ValueError(f"drop_mode={drop_mode!r} is not one of {DROP_MODES}")
        self.drop_mode = drop_mode
        self._drop_seed = self.seed if drop_seed is None else random_streams.check_seed(drop_seed)
        self.drop_filter = drop_filter
        self._step_keep = None
        self.keep_masks_pp = None
        if keep_masks is not None:
            self.set_keep_masks(keep_masks)

    def set_keep_masks(self, masks: KeepMasks) -> None:
        """Pre-pruning: trains only the kept entries of the masked kernels (and
        every other trainable variable). Zero the pruned weights first (the
        ``prune_*`` functions do by default)."""
        self.keep_masks_pp = masks
        self.set_trainable_set(ssgd_trainable_set(self.model, masks))

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        self._masked_optimizer = DroppingOptimizer(self.optimizer)
        with self.distribute_strategy.scope():
            self._masked_optimizer.build(self.trainable_set)

    # ----------------------------------------------------------- I_s per step

    def _drops(self, selection: VariableSelection) -> bool:
        return self.drop_rate > 0 and (self.drop_filter is None or bool(self.drop_filter(selection)))

    def keep_masks_for_step(self, step) -> list[tf.Tensor]:
        """``I_s`` of DP step ``step``: one boolean tensor (compact shape) per
        selection of the trainable set. Random: ``|I| - floor(pi_gd |I|)``
        coordinates uniformly at random from Philox keyed by the ``"gradient_dropping"`` stream at ``(drop_seed,
        step, k)``; magnitude: the coordinates with the largest ``|theta|``
        (current weights)."""
        step = tf.cast(step, tf.int64)
        key = random_streams.step_key(self._drop_seed, DROP_STREAM, step)
        masks = []
        for k, selection in enumerate(self.trainable_set):
            n = selection.size
            if not self._drops(selection) or _n_drop(self.drop_rate, n) == 0:
                masks.append(tf.ones(selection.compact_shape, tf.bool))
                continue
            n_keep = n - _n_drop(self.drop_rate, n)
            if self.drop_mode == "random":
                sub = tf.random.experimental.stateless_fold_in(key, k, alg="philox")
                score = tf.random.stateless_uniform([n], seed=sub, alg="philox")
            else:
                score = tf.abs(tf.reshape(selection.compact(tf.convert_to_tensor(selection.variable)), [-1]))
            kept = tf.math.top_k(score, k=n_keep, sorted=False).indices
            hit = tf.scatter_nd(kept[:, None], tf.ones([n_keep], tf.int32), [n])
            masks.append(tf.reshape(hit > 0, selection.compact_shape))
        return masks

    # ------------------------------------------------------------- the step

    def train_step(self, data):
        if self._scorer is not None or self.drop_rate == 0:
            self._step_keep = None
            self._masked_optimizer.keep_masks = None
            return super().train_step(data)
        self._step_keep = self.keep_masks_for_step(self.dp_step)
        self._masked_optimizer.keep_masks = self._step_keep
        try:
            return super().train_step(data)
        finally:
            self._step_keep = None
            self._masked_optimizer.keep_masks = None

    def _needs_per_example_gradients(self) -> bool:
        """Gradient dropping restricts each example's gradient to ``I_s`` before clipping."""
        return self.drop_rate > 0 or super()._needs_per_example_gradients()

    def _micro_batch_sum(self, x, y, weights):
        """Eq. (3): per-example gradients restricted to ``I_s`` before clipping."""
        if self._step_keep is None:
            return super()._micro_batch_sum(x, y, weights)
        valid = weights > 0
        result = self._get_engine()(x, y, self._per_example_loss, valid)
        grads = [tf.where(keep[None], g, tf.zeros_like(g)) for g, keep in zip(result.grads, self._step_keep)]
        sums, _ = clipped_sum(grads, self.clip_norm, result.valid)
        self._update_metrics(y, result.predictions, result.losses, weights)
        return sums

    def _noisy_mean(self, sums):
        """Eq. (4): noise ``sigma C zeta`` only on ``I_s``."""
        noisy = super()._noisy_mean(sums)
        if self._step_keep is None:
            return noisy
        return [tf.where(keep, g, tf.zeros_like(g)) for g, keep in zip(noisy, self._step_keep)]
