"""User rules are checked against the one-example tape gradient before the first DP step.

A rule registered with :func:`~sparta_tf.per_example.registry.register_layer_rule` (``verify=True``,
the default) computes a layer's per-example gradients, norms or clipped sums in its own way; a
wrong one would clip every example by a wrong norm, or sum a gradient that is not the one clipped,
while the run looks fine. So on the coverage check's few real examples ``x_1..x_B`` (no padding),
for every layer of the engine's plan whose rule needs checking, with ``g_i^ref`` the gradient of
``L_i`` alone (``tf.GradientTape``, one example at a time) restricted to the layer's selected
coordinates, and fixed distinct weights ``w_i = i / B``:

* the materialising rule (:func:`~sparta_tf.per_example.registry.rule_for`): ``g_i = g_i^ref``;
* the book-keeping rule (:func:`~sparta_tf.per_example.registry.ghost_rule_for`, where it computes
  norms itself): ``||g_i|| = ||g_i^ref||`` and ``sum_i w_i g_i = sum_i w_i g_i^ref`` (the weights
  stand in for the clip factors, so a rule that ignores them fails);

each within ``tol ||reference|| + atol`` (the tolerances of
:mod:`~sparta_tf.per_example.coverage`). A rule that fails, raises, or returns a result of the
wrong number or shape is refused with one :class:`UnsupportedLayerError` line naming the layer, the
rule and the variable.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from sparta_tf.backend import tf_variable, variable_key
from sparta_tf.per_example.engines import per_example_sum, record_output_gradients
from sparta_tf.per_example.errors import UnsupportedLayerError
from sparta_tf.per_example.probe import ABSOLUTE_FRACTION, traced_on_first_replica, within_bound
from sparta_tf.per_example.registry import ghost_rule_for, registration_for, rule_for, rule_name
from sparta_tf.per_example.rules.base import GhostRule
from sparta_tf.precision import to_accumulation


def checked_units(engine) -> list[tuple]:
    """``(layer, selection indices)`` of the engine's plan whose registered rule asks to be verified."""
    units = []
    for layer, _, indices in getattr(engine, "plan", []):
        entry = registration_for(layer)
        if entry is not None and entry.verify:
            units.append((layer, indices))
    return units


def _refuse(layer, what: str) -> UnsupportedLayerError:
    return UnsupportedLayerError(
        f"the rule {rule_name(layer)} registered for {type(layer).__name__} (layer {layer.name!r}) {what}; "
        "fix the rule, or register VjpRule() for the class with replace=True (the generic per-example VJP, "
        "exact for any layer)")


def _rule_results(engine, layer, indices, calls, batch, weights, refusals: list) -> dict:
    """What the layer's rules give on the recorded calls: ``grads`` (per-example, per selection),
    and where the ghost rule computes them itself, ``norms`` ([B]) and ``sums`` (per selection).
    A refusal is also appended to ``refusals``: raised while tracing, it reaches the caller wrapped."""
    selections = [engine.selections[k] for k in indices]
    recorded = [(call, delta) for call, delta in calls.get(id(layer), []) if delta is not None]
    results: dict = {}
    try:
        rule = rule_for(layer)
        grads = None
        for call, delta in recorded:
            part = rule.per_example_grads(layer, call, delta, selections)
            if len(part) != len(selections):
                raise _refuse(layer, f"returns {len(part)} per-example gradients for {len(selections)} variables")
            part = [per_example_sum(g, batch) if engine.is_grouped(layer) else g for g in part]
            grads = part if grads is None else [a + b for a, b in zip(grads, part)]
        results["grads"] = grads
        ghost = ghost_rule_for(layer)
        if type(ghost) is not GhostRule and len(recorded) == 1 and not engine.is_grouped(layer):
            call, delta = recorded[0]
            materialised: dict = {}
            results["norms"], _ = ghost.squared_norms(layer, call, delta, selections, materialised)
            scale = tf.reshape(tf.cast(weights, delta.dtype), [-1] + [1] * (delta.shape.rank - 1))
            keep = tf.ones([batch], tf.bool)
            rest = [p for p in range(len(selections)) if p not in materialised]
            sums = dict(zip(rest, ghost.weighted_sums(layer, call, delta * scale, keep, [selections[p] for p in rest])
                            if rest else []))
            for p, g in materialised.items():
                g = to_accumulation(g)
                sums[p] = tf.tensordot(tf.cast(weights, g.dtype), g, axes=1)
            results["sums"] = [sums[p] for p in range(len(selections))]
    except UnsupportedLayerError as refusal:
        refusals.append(refusal)
        raise
    except Exception as error:  # a user rule's own failure, reported as the rule's
        first_line = str(error).splitlines()[0] if str(error) else ""
        refusals.append(_refuse(layer, f"raised {type(error).__name__}: {first_line}"))
        raise refusals[-1] from error
    return results


def _reference(engine, units, x, y, loss_fn, batch: int) -> list:
    """``[per unit][per selection] [B, *compact]``: each example's gradient taken alone."""
    variables = [tf_variable(engine.selections[k].variable) for _, indices in units for k in indices]
    per_example = []
    for i in range(batch):
        x_i, y_i = tf.nest.map_structure(lambda t: t[i : i + 1], (x, y))
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(variables)
            loss = loss_fn(y_i, engine.model(x_i, training=True))[0]
        grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        per_example.append([to_accumulation(tf.convert_to_tensor(g)) for g in grads])
    stacked = [tf.stack([grads[k] for grads in per_example]) for k in range(len(variables))]
    out, position = [], 0
    for _, indices in units:
        out.append([engine.selections[k].compact(stacked[position + n], batch_dims=1) for n, k in enumerate(indices)])
        position += len(indices)
    return out


def check_user_rules(engine, x, y, loss_fn, strategy: tf.distribute.Strategy, tolerance: float) -> None:
    """Raises :class:`UnsupportedLayerError` for a registered rule that is not exact (module doc)."""
    units = checked_units(engine)
    if not units:
        return
    batch = int(tf.shape(tf.nest.flatten(x)[0])[0])
    weights = tf.range(1, batch + 1, dtype=tf.float32) / batch

    refusals: list[UnsupportedLayerError] = []

    def computation(x, y):
        valid = tf.ones([batch], tf.bool)
        recorded = record_output_gradients(engine.model, engine.layers, x, y, loss_fn, valid)
        ours = [_rule_results(engine, layer, indices, recorded.calls, batch, weights, refusals)
                for layer, indices in units]
        return ours, _reference(engine, units, x, y, loss_fn, batch)

    try:
        ours, reference = traced_on_first_replica(strategy, computation, x, y)
    except Exception as error:  # autograph wraps what a traced function raises
        if refusals:
            raise refusals[0] from error
        raise
    scale = max((float(np.max(np.abs(np.asarray(r)), initial=0.0)) for unit in reference for r in unit), default=0.0)
    atol = ABSOLUTE_FRACTION * scale
    for (layer, indices), got, truth in zip(units, ours, reference):
        keys = [variable_key(engine.selections[k].variable) for k in indices]
        for key, g, t in zip(keys, got["grads"] or [None] * len(keys), truth):
            ok, relative = (False, 1.0) if g is None else within_bound(g, t, tolerance, atol * batch)
            if not ok:
                raise _refuse(layer, f"gives wrong per-example gradients for variable {key!r} (relative error "
                                     f"{relative:.2g} against the one-example tape gradient)")
        if "norms" in got:
            truth_norms = np.sqrt(sum(np.sum(np.reshape(np.asarray(t, np.float64), (batch, -1)) ** 2, axis=1)
                                      for t in truth))
            norms = np.sqrt(np.maximum(np.asarray(got["norms"], np.float64), 0.0))
            ok, relative = within_bound(norms, truth_norms, tolerance, atol * batch)
            if not ok:
                raise _refuse(layer, f"gives wrong per-example norms (relative error {relative:.2g} against the "
                                     "one-example tape gradient)")
            w = np.asarray(weights, np.float64)
            for key, s, t in zip(keys, got["sums"], truth):
                weighted_truth = np.tensordot(w, np.asarray(t, np.float64), axes=1)
                ok, relative = within_bound(s, weighted_truth, tolerance, atol * batch)
                if not ok:
                    raise _refuse(layer, f"gives a wrong weighted sum sum_i c_i g_i for variable {key!r} (relative "
                                         f"error {relative:.2g} against the one-example tape gradient)")
