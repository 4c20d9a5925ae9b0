"""DP-FROST: differentially private selection of parameter partitions.

Implements DP-FROST ("Differentially Private Fine-tuning of pRe-trained mOdels
with freezing model parameTers", see the paper text) before DP-SGD training:

1. **Partitions.** ``S = {P_1, ..., P_M}``: every layer's trainable variables
   form one partition; ``|Theta|`` is the number of trainable parameters.

2. **Noisy partition-wise gradient magnitudes (PGMs)**, Definitions 7-8 and
   Lemma 3: DP-MG, DP-MGN or DP-MGNA of the partitions ``R`` still frozen, plus
   ``N(0, sigma_ps^2 Delta^2 I)``, one Poisson-subsampled Gaussian mechanism
   (rate ``q_ps``) per PSEL iteration; the math is in
   :mod:`sparta_tf.selection.frost_magnitudes`.

3. **PGM-EST** (Lemmas 4-6): with ``v~_{j,i} = lambda_j v_i + N(0, sigma^2
   Delta_j^2)`` for ``P_i in R_{j-1}``, alternate
   ``v_i = sum_j v~_{j,i} lambda_j / Delta_j^2 / sum_j lambda_j^2 / Delta_j^2``
   (Lemma 5) and ``lambda_j = sum_i v~_{j,i} v_i / sum_i v_i^2`` (Lemma 4);
   ``Var(v_i) = sigma^2 / sum_{j} lambda_j^2 / Delta_j^2`` (Lemma 6);
   :mod:`sparta_tf.selection.pgm`.

4. **PSEL** (Algorithm 4): ``T`` rounds on fresh Poisson samples; each round
   re-estimates ``v``, sets ``mu_thres`` to the largest ``v`` of the partitions
   expected to stay frozen, and adds partitions with
   ``v_i > mu_thres + nu sqrt(Var v_i)`` while the selected parameters stay
   ``<= t gamma |Theta| / T`` (in the last round: the largest ``v_i``).

5. **ComputeSigma** (Algorithms 2-3): ``sigma_SGD`` spends ``r_eps * eps``
   alone; ``sigma_ps`` is then the smallest noise multiplier such that DP-SGD
   composed with the ``T`` selection mechanisms spends ``<= eps``.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from sparta_tf import method_spec, random_streams
from sparta_tf import trainable as trainable_lib
from sparta_tf.dp_step.noise import gaussian_noise
from sparta_tf.dp_step.user_units import user_mean_gradients
from sparta_tf.losses import per_example_loss_fn
from sparta_tf.per_example import make_engine
from sparta_tf.privacy import accounting
from sparta_tf.privacy.plan import calibrate_split
from sparta_tf.privacy.sampling import PoissonSampler
from sparta_tf.privacy.user_sampling import UserPoissonSampler
from sparta_tf.selection.frost_magnitudes import (
    DEFAULT_ALPHA,
    DEFAULT_METHOD,
    check_magnitude,
    clipped_partition_sums,
    magnitudes_from_sums,
    partitions,
    pgm_sensitivity,
)
from sparta_tf.selection.pgm import DEFAULT_J, pgm_est, pgm_variance

SELECTION_PHASE = "frost_selection"
SELECTION_KIND = "frost_selection"
SAMPLING_STREAM = "frost_sampling"  # named random streams (sparta_tf.random_streams)
NOISE_STREAM = "frost_noise"
USER_SAMPLING_STREAM = "frost_users"
USER_EXAMPLES_STREAM = "frost_user_examples"

# Paper defaults (Section 5): MGNA, alpha = 1, r_eps = 0.9, T = 5, q_ps = 0.02, nu = 5, J = 1000; the method's
# options are the dp_frost method's (sparta_tf.method_spec), J (PGM-EST's iterations) is not an option.
_OPTIONS = method_spec.SPECS["dp_frost"].defaults()
DEFAULT_R_EPS = _OPTIONS["r_eps"]
DEFAULT_T = _OPTIONS["frost_iterations"]
DEFAULT_Q_PS = _OPTIONS["q_ps"]
DEFAULT_NU = _OPTIONS["nu"]


# --------------------------------------------------------------------------
# PSEL (Algorithm 4).
# --------------------------------------------------------------------------


Observer = Callable[[int, np.ndarray], "tuple[np.ndarray, float]"]
"""``observe(t, remaining) -> (noisy mu for partitions `remaining`, Delta_t)`` (one mechanism run)."""


def no_partition_message(sizes: Sequence[int], total_params: int, gamma: float) -> str:
    """The one-line error for a PSEL run that selected nothing: either no partition fits into the budget
    ``gamma |Theta|`` at all, or (PSEL stops at the first partition, by noisy magnitude, that does not fit)
    the last round, whose limit is the whole budget, ranked a partition too large for it first (earlier rounds
    have smaller limits, or chose none above their thresholds), which the noise can do."""
    budget, smallest = gamma * int(total_params), int(min(sizes))
    if smallest > budget:
        return (f"DP-FROST selected no partition: gamma={gamma} allows {budget:,.0f} parameters, fewer than the "
                f"smallest partition ({smallest:,}); raise gamma to at least {smallest / int(total_params):.3g}")
    return (f"DP-FROST selected no partition: its last round, which takes whatever fits, ranked first by its noisy "
            f"magnitude a partition larger than gamma={gamma} allows ({budget:,.0f} of {int(total_params):,} parameters), and PSEL stops "
            "there; raise gamma so that more partitions fit, or lower the selection noise "
            "(a smaller r_eps or a larger epsilon)")


def psel(
    observe: Observer,
    sizes: Sequence[int],
    total_params: int,
    noise_multiplier: float,
    gamma: float,
    iterations: int = DEFAULT_T,
    nu: float = DEFAULT_NU,
    q_ps: float = DEFAULT_Q_PS,
    pgm_iterations: int = DEFAULT_J,
) -> tuple[np.ndarray, dict]:
    """Iterative partition selection (Algorithm 4); returns (selected indices, info).

    ``observe(t, R_{t-1})`` runs the DP-MG* mechanism on a fresh Poisson sample
    ``X_t`` (rate ``q_ps``) over the remaining partitions. Round ``t``:
    ``v, lambda = PGM-EST``; ``sigma_v = sqrt(Var v)`` (Lemma 6); sort ``R_{t-1}``
    by ``v`` ascending; ``mu_thres = v_{i_j}`` for the first ``j`` whose cumulative
    size reaches ``(1 - gamma)|Theta|``; then, from the largest ``v`` down and
    while ``|P_{i_j}| + sum_{S_t}|P| <= t gamma |Theta| / T``, add ``P_{i_j}`` if
    ``t = T`` or ``v_{i_j} > mu_thres + nu sigma_{v_{i_j}}``. So the selected
    parameter count never exceeds ``gamma |Theta|``.
    """
    sizes = np.asarray(sizes, np.int64)
    m, total, budget_all = len(sizes), int(total_params), gamma * int(total_params)
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
    if iterations < 1:
        raise ValueError("the number of PSEL iterations T must be >= 1")
    obs_rows, deltas = [], []
    selected: list[int] = []
    remaining = np.arange(m)
    v = lam = var = None
    rounds = 0
    for t in range(1, iterations + 1):
        if remaining.size == 0:
            break
        noisy, delta = observe(t, remaining)
        rounds += 1
        row = np.full(m, np.nan)
        row[remaining] = noisy
        obs_rows.append(row)
        deltas.append(float(delta))
        obs = np.stack(obs_rows)
        v, lam = pgm_est(obs, deltas, q_ps, pgm_iterations)
        var = pgm_variance(noise_multiplier, lam, deltas, np.isfinite(obs))
        order = remaining[np.argsort(v[remaining], kind="stable")]  # ascending v
        cumulative = np.cumsum(sizes[order])
        reach = np.nonzero(cumulative >= (1.0 - gamma) * total)[0]
        thres = v[order[reach[0] if reach.size else len(order) - 1]]
        limit = t * budget_all / iterations
        used = int(sizes[selected].sum()) if selected else 0
        for i in order[::-1]:
            if sizes[i] + used > limit:
                break
            if t == iterations or v[i] > thres + nu * math.sqrt(max(var[i], 0.0)):
                selected.append(int(i))
                used += int(sizes[i])
        remaining = np.array([i for i in remaining if i not in set(selected)], dtype=np.int64)
    info = {"estimates": v, "lambdas": lam, "variances": var, "deltas": deltas, "rounds": rounds}
    return np.array(sorted(selected), dtype=np.int64), info


# --------------------------------------------------------------------------
# ComputeSigma (Algorithms 2-3) and the ledger.
# --------------------------------------------------------------------------


def compute_sigmas(
    target_epsilon: float,
    delta: float,
    r_eps: float = DEFAULT_R_EPS,
    *,
    sample_rate: float,
    steps: int,
    selection_rate: float = DEFAULT_Q_PS,
    selection_steps: int = DEFAULT_T,
    accountant: str = "pld",
    rtol: float = 1e-4,
) -> tuple[float, float]:
    """ComputeSigma: returns ``(sigma_selection, sigma_training)``.

    ``sigma_training`` is the smallest noise multiplier with
    ``eps(DP-SGD) <= r_eps * eps``; ``sigma_selection`` the smallest with
    ``eps(DP-SGD o selection) <= eps`` (selection: ``selection_steps``
    mechanisms at Poisson rate ``selection_rate``), found by
    ``dp_accounting.calibrate_dp_mechanism`` (which guarantees ``<= eps``).
    """
    eps = accounting.check_target_epsilon(target_epsilon)
    if not 0.0 < r_eps < 1.0:
        raise ValueError(f"r_eps must be in (0, 1), got {r_eps!r}")
    accounting.check_steps(selection_steps, "selection_steps")
    return calibrate_split(eps, delta, r_eps, sample_rate=sample_rate, steps=steps, before_rate=selection_rate,
                           before_count=selection_steps, accountant=accountant, rtol=rtol)


def record_selection(ledger, noise_multiplier: float, sample_rate: float, count: int) -> None:
    """Records the ``count`` PSEL mechanisms ``M_{q_ps, sigma_ps}`` (phase ``"frost_selection"``)."""
    ledger.record(noise_multiplier, sample_rate, count, kind=SELECTION_KIND, phase=SELECTION_PHASE)


# --------------------------------------------------------------------------
# DP-FROST selection on a Keras model.
# --------------------------------------------------------------------------


def _rows(x, y, index: np.ndarray):
    take = lambda t: tf.gather(t, index) if isinstance(t, tf.Tensor) else np.asarray(t)[index]
    return tf.nest.map_structure(take, x), tf.nest.map_structure(take, y)


def _batches(x, y, index: np.ndarray, batch_size: int):
    for start in range(0, len(index), batch_size):
        yield _rows(x, y, index[start:start + batch_size])


def _round_units(n: int, q_ps: float, batch_size: int, seed: int, users, examples_per_user: int | None):
    """``units(t, x, y)``: round ``t``'s Poisson sample as ``(x, y, row_weights)`` batches: examples at rate
    ``q_ps`` (``row_weights`` None), or with ``users`` users at ``q_ps``, ``k = examples_per_user`` rows each
    (:meth:`~sparta_tf.privacy.user_sampling.UserPoissonSampler.padded_rows`: weights ``1 / k_v``, 0 on
    padding), whole users per batch."""
    if users is None:
        sampler = PoissonSampler(n, q_ps, batch_size, seed=seed, stream=SAMPLING_STREAM)

        def examples(t: int, x, y):
            index = np.nonzero(sampler.sample_mask(t).numpy())[0]
            return ((xb, yb, None) for xb, yb in _batches(x, y, index, batch_size))

        return examples
    if examples_per_user is None:
        raise ValueError("DP-FROST over users needs examples_per_user (the most examples of one user a round takes)")
    sampler = UserPoissonSampler(users, q_ps, examples_per_user, units_per_batch=max(1, batch_size // examples_per_user),
                                 seed=seed, stream=USER_SAMPLING_STREAM, examples_stream=USER_EXAMPLES_STREAM)

    def user_units(t: int, x, y):
        for indices, weights in sampler.row_batches(t):
            yield *_rows(x, y, indices), tf.constant(weights)

    return user_units


def frost_select(
    model: tf.keras.Model,
    x,
    y,
    loss,
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    gamma: float,
    method: str = DEFAULT_METHOD,
    alpha: int = DEFAULT_ALPHA,
    clip_norm: float = 1.0,
    r_eps: float = DEFAULT_R_EPS,
    iterations: int = DEFAULT_T,
    q_ps: float = DEFAULT_Q_PS,
    nu: float = DEFAULT_NU,
    pgm_iterations: int = DEFAULT_J,
    accountant: str = "pld",
    ledger=None,
    physical_batch_size: int = 256,
    seed: int | None = None,
    engine: str = "auto",
    noise_multiplier: float | None = None,
    users=None,
    examples_per_user: int | None = None,
) -> tuple[trainable_lib.TrainableSet, dict]:
    """DP-FROST (Algorithm 1, lines 1-3): ComputeSigma, then PSEL on the model's partitions.

    ``sample_rate`` / ``steps``: the DP-SGD run that follows (``q_SGD``, ``T_SGD``).
    Returns the selected partitions (whole kernel + bias, dense) as a
    :class:`TrainableSet` and an info dict with ``sigma_training`` (use it for
    DP-SGD), ``sigma_selection``, the selected partition names, estimates, etc.
    If ``ledger`` is given the selection mechanisms are recorded in it; the
    caller records the DP-SGD steps with ``sigma_training`` while training.
    The paper keeps nothing else trainable (no separate head rule). If no
    partition fits into ``gamma |Theta|`` the TrainableSet cannot be built and
    a ValueError is raised. ``noise_multiplier``: the selection rounds' sigma
    when the caller calibrated it already (a :class:`~sparta_tf.privacy.plan.PrivacyPlan`);
    then ``info["sigma_training"]`` is None. The ledger is charged all
    ``iterations`` rounds, also when PSEL stops early (all partitions chosen).

    ``users`` (one id per example; user-level DP): each round Poisson-samples users at ``q_ps`` (the
    secret ``"frost_users"`` stream), and a sampled user's unit is the mean gradient of at most
    ``examples_per_user`` of its examples (``"frost_user_examples"``), clipped once as an example's is
    (:func:`~sparta_tf.dp_step.user_units.user_mean_gradients`): one user moves each round's sums as one
    example does, so the rounds' noise and accounting are unchanged, over users.
    """
    check_magnitude(method, alpha)
    parts = partitions(model)
    sizes = [p.size for p in parts]
    total = sum(int(np.prod(v.shape.as_list())) for v in model.trainable_variables)
    if noise_multiplier is None:
        sigma_sel, sigma_sgd = compute_sigmas(
            target_epsilon, delta, r_eps, sample_rate=sample_rate, steps=steps,
            selection_rate=q_ps, selection_steps=iterations, accountant=accountant,
        )
    else:
        sigma_sel, sigma_sgd = accounting.check_noise_multiplier(noise_multiplier), None
    variables = [v for p in parts for v in p.variables]
    grad_engine = make_engine(model, variables, engine, materialise=True)
    loss_fn = per_example_loss_fn(loss)
    n = len(tf.nest.flatten(y)[0])
    seed = random_streams.resolve_seed(seed)
    units = _round_units(n, q_ps, physical_batch_size, seed, users, examples_per_user)
    owner = np.concatenate([[k] * len(p.variables) for k, p in enumerate(parts)]).astype(int)

    def observe(t: int, remaining: np.ndarray) -> tuple[np.ndarray, float]:
        rem_sizes = [sizes[i] for i in remaining]
        sums = [np.zeros(s) for s in rem_sizes]
        for xb, yb, row_weights in units(t, x, y):  # the round's Poisson sample X_t, of examples or users
            b = len(tf.nest.flatten(yb)[0])
            out = grad_engine(xb, yb, loss_fn, tf.ones([b], tf.bool) if row_weights is None else row_weights > 0)
            flat = [tf.reshape(g, [b, -1]) for g in out.grads]
            if row_weights is not None:  # each user's mean, a unit clipped once (padding units: zero)
                flat, usable = user_mean_gradients(flat, row_weights, out.valid, examples_per_user)
                flat = [tf.where(usable[:, None], f, tf.zeros_like(f)) for f in flat]
            flat = [f.numpy() for f in flat]
            grads = [np.concatenate([f for f, o in zip(flat, owner) if o == i], axis=1) for i in remaining]
            for s, part_sum in zip(sums, clipped_partition_sums(grads, method, alpha, clip_norm)):
                s += part_sum
        mu = magnitudes_from_sums(sums, method, alpha)
        sens = pgm_sensitivity(rem_sizes, method, alpha, clip_norm)
        (noise,) = gaussian_noise([mu.shape], sigma_sel * sens, seed, t, dtype=tf.float64, stream=NOISE_STREAM)
        return mu + noise.numpy(), sens

    chosen, info = psel(observe, sizes, total, sigma_sel, gamma, iterations, nu, q_ps, pgm_iterations)
    if ledger is not None:
        record_selection(ledger, sigma_sel, q_ps, iterations)
    selected = [parts[i] for i in chosen]
    if not selected:
        raise ValueError(no_partition_message(sizes, total, gamma))
    trainable = trainable_lib.TrainableSet([trainable_lib.dense(v) for p in selected for v in p.variables])
    info.update(
        sigma_selection=sigma_sel,
        sigma_training=sigma_sgd,
        selected=[p.name for p in selected],
        partitions=[p.name for p in parts],
        partition_sizes=sizes,
        total_params=total,
        selected_params=int(sum(p.size for p in selected)),
    )
    return trainable, info
