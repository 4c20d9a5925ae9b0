"""What a finished ``sparta-train`` run reports in ``results.json`` (:func:`run_results`).

The privacy numbers are the ledger's (what ran and was charged), next to the plan's (what was
planned): a resumed run whose interrupted steps were charged may stop before the plan's end.

With weight averaging (``training.ema``), ``test_accuracy`` is that of the weights the model and the
export hold (``test_weights``: ``"ema"`` or ``"raw"``, from ``training.use_ema_weights``), and
``test_accuracy_raw_weights`` / ``test_accuracy_ema_weights`` are both, from the same run: the average
is post-processing, so both numbers have the run's one (epsilon, delta).
"""

from __future__ import annotations

from sparta_tf.dp_step.usable_examples import METRIC_NAME as NON_FINITE
from sparta_tf.privacy.plan import PrivacyPlan


def run_results(config: dict, dp, plan: PrivacyPlan, dataset, phase_seconds: dict, timings: dict, history) -> dict:
    """``results.json``'s content after ``dp.fit``: test accuracy and loss, what the ledger spent (its
    epsilon, None when not private, and why), the plan, the steps that ran and the timings. ``n`` counts
    the privacy ``unit``: examples, or users (then with ``examples_per_user``)."""
    test_loss, test_accuracy = dp.evaluate(dataset.x_test, dataset.y_test, verbose=0)[:2]
    return {
        "method": config["method"]["name"],
        "private": dp.ledger.is_private,
        "nonprivate_reasons": list(dp.ledger.nonprivate_reasons),
        "epsilon": dp.ledger.epsilon() if dp.ledger.is_private else None,  # None: not DP
        "privacy_caveats": dp.ledger.caveats(),
        "target_epsilon": plan.target_epsilon,
        "delta": plan.delta,
        "noise_multiplier": dp.mechanism.noise_multiplier,  # the plan's, as the steps ran them
        "sample_rate": dp.mechanism.sample_rate,
        "clip_norm": dp.mechanism.clip_norm,
        "steps": dp.ledger.steps,
        "optimizer_steps": int(dp.optimizer.iterations.numpy()),  # = plan.update_steps: the schedule's span
        "epochs": plan.epochs,
        **what_ran(dp, plan),
        "n": plan.n,
        "unit": plan.unit,
        **({} if dp.users is None else {"examples_per_user": dp.users.examples_per_user}),
        "plan": plan.to_json(),
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        **averaged_weights_results(dp, dataset, float(test_accuracy)),
        "trainable_fraction": dp.trainable_set.fraction_of(dp.model),
        "seconds_per_phase": phase_seconds,
        **timings,
        "non_finite_examples": int(sum(history.history.get(NON_FINITE, []))),  # sampled, dropped: the epochs run here
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    }


def what_ran(dp, plan: PrivacyPlan) -> dict:
    """Training steps and epochs that really ran (a resumed run whose charged interrupted steps no
    longer fit the budget stops early) against the plan."""
    phases = {phase.name for phase in plan.phases}
    ran = sum(entry.count for entry in dp.ledger.entries if entry.phase in phases)
    stopped = dp.privacy_callback is not None and dp.privacy_callback.budget_exhausted
    return {"planned_steps": plan.steps, "training_steps_run": ran,
            "epochs_completed": round(ran / plan.steps_per_epoch, 4),
            "stopped_early": ("the privacy budget ran out (steps of an interrupted run were charged)"
                              if stopped else None)}


def averaged_weights_results(dp, dataset, test_accuracy: float) -> dict:
    """With a weight average: which weights ``test_accuracy`` measured and the test accuracy of the raw
    and the averaged weights (the other one evaluated by swapping, then swapped back); else nothing."""
    average = dp.weight_average
    if average is None:
        return {}
    held, other = ("ema", "raw") if average.holds_averages else ("raw", "ema")
    to_other, back = ((average.use_raw, average.use_averages) if held == "ema"
                      else (average.use_averages, average.use_raw))
    to_other()
    accuracy = {held: test_accuracy, other: float(dp.evaluate(dataset.x_test, dataset.y_test, verbose=0)[1])}
    back()
    return {"test_weights": held, "test_accuracy_raw_weights": accuracy["raw"],
            "test_accuracy_ema_weights": accuracy["ema"]}
