"""The Keras ``Model`` training API where Keras 2 and Keras 3 differ, for :class:`~sparta_tf.dp_model.DPModel`.

A ``DPModel`` overrides ``train_step`` / ``test_step`` and keeps its own loss
tracker, so it touches the compiled metrics, the traced step and the progress
bar directly. The names differ between the lines:

=======================  =====================================  ===========================================
what                     Keras 2                                Keras 3
=======================  =====================================  ===========================================
compiled metrics         ``model.compiled_metrics`` (a list in  ``model._compile_metrics`` (one metric whose
                         ``.metrics``)                          ``result()`` is a dict), None until compiled
build them eagerly       ``.build(y_pred, y_true)``             ``.build(y_true, y_pred)``
compiled?                ``model._is_compiled``                 ``model.compiled``
progress bar             ``ProgbarLogger(count_mode="steps")``  ``ProgbarLogger()`` (counts steps)
steps a call runs        ``model._steps_per_execution`` (a      ``model.steps_per_execution`` (an int)
                         variable; None before ``compile``)
an epoch of ``S`` steps  ``S`` (the last call runs fewer)       ``ceil(S / N) N``: every call runs all ``N``
=======================  =====================================  ===========================================

Keras 3's ``fit`` makes the train function once per call, so a step retraced
inside a running ``fit`` (a phase boundary) is rebuilt at once on both lines.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from sparta_tf.backend import KERAS3


def _compiled(model: tf.keras.Model):
    """The compiled-metrics container, or None (not compiled, or nothing to compile)."""
    return getattr(model, "_compile_metrics", None) if KERAS3 else model.compiled_metrics


def compiled_metrics(model: tf.keras.Model) -> list:
    """The metrics ``compile`` created (Keras 3: the one container metric, whose result is a dict)."""
    container = _compiled(model)
    if container is None:
        return []
    return [container] if KERAS3 else list(container.metrics)


def update_compiled_metrics(model: tf.keras.Model, y, predictions, sample_weight) -> None:
    """Updates the compiled metrics with a batch (``sample_weight``: the 0/1 padding mask)."""
    container = _compiled(model)
    if container is not None:
        container.update_state(y, predictions, sample_weight)


def metrics_result(model: tf.keras.Model) -> dict:
    """``model.get_metrics_result()``, on several replicas from the metric states summed over them.

    Keras 3 reduces a step's per-replica results by their mean, so a batch split unevenly over the
    replicas (``m`` examples on ``R`` replicas, ``R`` not dividing ``m``) weighs the replicas' examples
    unequally: 2 of 5 correct read as 0.4167 on two replicas. Metric states are sums (totals, counts,
    confusion counts), so ``result(sum_r state_r)`` is the result over every example, the same on every
    replica. Keras 2 already aggregates the states (``SyncOnRead`` sums); so does one replica.
    """
    context = tf.distribute.get_replica_context()
    if not KERAS3 or context is None or context.num_replicas_in_sync == 1:
        return model.get_metrics_result()
    results = {}
    for metric in model.metrics:
        summed = [context.all_reduce(tf.distribute.ReduceOp.SUM, tf.convert_to_tensor(v)) for v in metric.variables]
        result = metric.stateless_result(summed)
        results.update(result if isinstance(result, dict) else {metric.name: result})
    return results


def build_compiled_metrics(model: tf.keras.Model, predict: Callable[[], object], y) -> None:
    """Creates the compiled metrics' variables now (no state updated) from ``predict()`` (the model's
    output on a few examples) and their labels ``y``, unless already built."""
    container = _compiled(model)
    if container is None or container.built:
        return
    predictions = predict()
    if KERAS3:
        container.build(y, predictions)
    else:
        container.build(predictions, y)


def is_compiled(model: tf.keras.Model) -> bool:
    """Whether ``compile`` has run on ``model``."""
    return bool(getattr(model, "compiled", False)) if KERAS3 else bool(getattr(model, "_is_compiled", False))


def retrace(model: tf.keras.Model) -> None:
    """Drops ``model``'s traced train step; rebuilds it at once when compiled (inside a running ``fit``,
    whose loop calls ``model.train_function`` directly)."""
    model.train_function = None
    if is_compiled(model):
        model.make_train_function(force=True)


def steps_per_execution(model: tf.keras.Model) -> int:
    """The training steps one call of ``model``'s train function runs (``compile(steps_per_execution=N)``;
    1 when not compiled). Both lines call ``on_train_batch_begin`` once per call, before all ``N``."""
    value = getattr(model, "steps_per_execution", None) if KERAS3 else getattr(model, "_steps_per_execution", None)
    return 1 if value is None else max(int(tf.keras.backend.get_value(value)), 1)


def check_whole_calls(model: tf.keras.Model, steps_per_epoch: int) -> None:
    """One line, before anything is charged, when ``N = steps_per_execution`` does not divide an epoch's
    ``steps_per_epoch`` on Keras 3: every call runs all ``N`` steps there, so each epoch would run
    ``ceil(S / N) N`` steps and the phases the privacy plan counts in epochs would drift off it."""
    n = steps_per_execution(model)
    if KERAS3 and n > 1 and steps_per_epoch % n:
        raise ValueError(f"steps_per_execution={n} does not divide an epoch's {steps_per_epoch} DP steps: Keras 3 "
                         f"would run {-(-steps_per_epoch // n) * n} steps an epoch, off the privacy plan; compile with "
                         f"a steps_per_execution that divides {steps_per_epoch} (e.g. 1)")


def step_progress_bar() -> tf.keras.callbacks.Callback:
    """A progress bar that counts steps (not examples)."""
    if KERAS3:
        return tf.keras.callbacks.ProgbarLogger()
    return tf.keras.callbacks.ProgbarLogger(count_mode="steps")
