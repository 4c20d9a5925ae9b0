"""DP-FROST and DP-SSGD in ``sparta-train``: methods that choose their trainable set before ``fit``.

* ``dp_frost``: ``compute_sigmas`` splits the budget (``r_eps`` to training);
  PSEL's ``frost_iterations`` selection rounds at rate ``q_ps`` are recorded in
  the run's ledger before training; the selected partitions are trained with
  DP-SGD at ``sigma_training``.
* ``dp_ssgd``: pre-pruning (``random`` / ``synflow``: free; ``dp_snip``: one
  Gaussian mechanism on the whole training set, charged to the ledger, and the
  training sigma is calibrated so that both together spend the target), then
  :class:`sparta_tf.ssgd.SSGDModel` with gradient dropping at every step.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from sparta_tf.privacy import PrivacyLedger, steps_per_epoch

EXTERNAL = ("dp_frost", "dp_ssgd")


def training_sigma_and_prior(config: dict, n: int) -> tuple[float | None, list[tuple[str, float, float, int]]]:
    """``(training sigma or None = calibrate normally, mechanisms charged before training)``."""
    method, privacy, training = config["method"], config["privacy"], config["training"]
    q = min(1.0, training["batch_size"] / n)
    steps = training["epochs"] * steps_per_epoch(q)
    if method["name"] == "dp_frost":
        from sparta_tf.selection.frost import compute_sigmas

        sigma_sel, sigma_sgd = compute_sigmas(
            privacy["target_epsilon"], privacy["delta"], method["r_eps"], sample_rate=q, steps=steps,
            selection_rate=method["q_ps"], selection_steps=method["frost_iterations"],
            accountant=privacy["accountant"],
        )
        return sigma_sgd, [("frost_selection", sigma_sel, method["q_ps"], method["frost_iterations"])]
    if method["name"] == "dp_ssgd" and method["prune"] == "dp_snip":
        prior = [("pre-pruning", method["snip_noise_multiplier"], 1.0, 1)]
        return _calibrate_after(prior, q, steps, privacy), prior
    return None, []


def _calibrate_after(prior, q: float, steps: int, privacy: dict) -> float:
    """Smallest training sigma (to 0.1%) such that ``prior`` + training spend <= the target."""
    ledger = PrivacyLedger(privacy["delta"], accountant=privacy["accountant"])
    for phase, sigma, rate, count in prior:
        ledger.record(sigma, rate, count, phase=phase)
    target = privacy["target_epsilon"]
    if ledger.epsilon() >= target:
        raise ValueError(f"the pre-pruning mechanism alone spends epsilon={ledger.epsilon():.3g} >= "
                         f"target {target:g}; raise method.snip_noise_multiplier")

    def fits(sigma):
        return ledger.epsilon_if([(sigma, q, steps, "dp_sgd_step", "train")]) <= target

    low, high = 0.05, 1.0
    while not fits(high):
        low, high = high, high * 2
    while high / low > 1.001:
        middle = math.sqrt(low * high)
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def build_dp_model(config: dict, model: tf.keras.Model, dp_kwargs: dict):
    """The DP model of an external method (SSGDModel for dp_ssgd, DPModel otherwise)."""
    import sparta_tf
    from sparta_tf.ssgd import SSGDModel

    method = config["method"]
    if method["name"] == "dp_ssgd":
        return SSGDModel(model, drop_rate=method["drop_rate"], drop_mode=method["drop_mode"], **dp_kwargs)
    return sparta_tf.DPModel(model, **dp_kwargs)


def choose_trainable_set(config: dict, dp, dataset, loss, plan) -> dict:
    """Runs DP-FROST's selection or DP-SSGD's pre-pruning on ``dp``; returns info for results.json."""
    method, privacy = config["method"], config["privacy"]
    seed = config["training"]["seed"]
    if method["name"] == "dp_frost":
        from sparta_tf.selection.frost import frost_select

        selected, info = frost_select(
            dp.model, dataset.x_train, dataset.y_train, loss, target_epsilon=privacy["target_epsilon"],
            delta=privacy["delta"], sample_rate=plan.sample_rate, steps=plan.steps, gamma=method["gamma"],
            method=method["frost_magnitude"], alpha=method["frost_alpha"], clip_norm=privacy["clip_norm"],
            r_eps=method["r_eps"], iterations=method["frost_iterations"], q_ps=method["q_ps"], nu=method["nu"],
            accountant=privacy["accountant"], ledger=dp.ledger, seed=seed,
        )
        dp.set_trainable_set(selected)
        return {"frost_selected_partitions": [str(s) for s in info.get("selected", [])],
                "frost_sigma_selection": float(info["sigma_selection"])}
    from sparta_tf import ssgd

    prune = method["prune"]
    rate = method["prune_rate"]
    if prune == "none" or rate == 0:
        return {"prune": "none"}
    if prune == "random":
        masks = ssgd.prune_random(dp.model, rate, seed=seed)
    elif prune == "synflow":
        masks = ssgd.prune_synflow(dp.model, rate, iterations=method["synflow_iterations"])
    else:
        masks = ssgd.prune_dp_snip(dp.model, dataset.x_train, dataset.y_train, loss, rate,
                                   method["snip_noise_multiplier"], privacy["clip_norm"], 1.0, dp.ledger, seed=seed)
    dp.set_keep_masks(masks)
    return {"prune": prune, "kept_fraction_of_pruned_kernels": float(ssgd.keep_fraction(masks))}


def planned_phases(config: dict, model: tf.keras.Model) -> list[tuple[str, int, int | None]]:
    """Training phase for the plan: trainable coordinates as far as known before selection."""
    method, epochs = config["method"], config["training"]["epochs"]
    total = int(sum(np.prod(v.shape.as_list()) for v in model.trainable_variables))
    if method["name"] == "dp_frost":
        return [("train", epochs, None)]
    from sparta_tf import ssgd

    pruned = sum(int(np.prod(v.shape.as_list())) for v in ssgd.prunable_variables(model))
    kept = total - int(pruned * (method["prune_rate"] if method["prune"] != "none" else 0.0))
    per_step = int(kept * (1 - method["drop_rate"]))
    return [(f"train (~{per_step:,} updated per step)", epochs, kept)]
