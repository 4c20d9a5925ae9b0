"""Per-example gradient engines.

An engine is built for a trainable set (:mod:`sparta_tf.trainable`; a plain
list of variables means "all of each") and maps a batch ``(x, y)`` and a
per-example loss to

* ``grads[k]``: ``[B, *compact_shape_k]``, the gradient of ``L_i`` w.r.t. the
  trainable coordinates of selection ``k`` for every example ``i``;
* ``losses``: ``[B]`` per-example losses ``L_i``;
* ``predictions``: the model output on the batch (for metrics).

Two engines compute the same quantity:

* :class:`LayerwiseEngine`: one batched forward and one batched backward pass
  to the layer outputs, then a per-layer rule turns layer inputs and output
  gradients into per-example weight gradients
  (:mod:`sparta_tf.per_example.registry`). Used when every variable asked
  for belongs to a layer that owns it directly, or to a recurrent layer's cell
  (:mod:`sparta_tf.per_example.rules.recurrent`); layers inside ``TimeDistributed``
  have their per-row gradients summed per example.
* :class:`VectorizedEngine`: ``tf.vectorized_map`` over examples of the
  gradient of a batch-of-one forward pass. Works for any Keras model.

:func:`~sparta_tf.per_example.factory.make_engine` picks the engine.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import tensorflow as tf

from sparta_tf.backend import owned_variables, tf_variable
from sparta_tf.keras_layers import all_layers
from sparta_tf.per_example.errors import UnsupportedLayerError
from sparta_tf.per_example.recording import install_hook, install_reshape_hook, recording
from sparta_tf.per_example.registry import rule_for
from sparta_tf.per_example.rules.recurrent import cell_layers, check_recurrent_layer, is_recurrent
from sparta_tf.precision import accumulation_dtype, to_accumulation
from sparta_tf.trainable import VariableSelection

PerExampleLoss = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


class PerExampleGradients(NamedTuple):
    grads: list  # [B, *variable.shape] per variable
    losses: tf.Tensor  # [B]
    predictions: object  # model output structure
    valid: tf.Tensor  # [B] the examples to clip and sum: real ones whose inputs are finite (finite_rows)


class RecordedPass(NamedTuple):
    """What :func:`record_output_gradients` returns."""

    calls: dict  # {id(layer): [(RecordedCall, delta)]}
    losses: tf.Tensor  # [B]
    predictions: object
    valid: tf.Tensor  # [B] real examples with finite inputs (finite_rows)
    batch_gradients: list  # of the watched variables (None where unconnected); [] when none watched


def finite_rows(x, valid: tf.Tensor):
    """``(x, usable)``: ``usable = valid`` and every floating-point input of the example finite;
    the inputs of examples that are not usable (padding, NaN or inf) set to zero.

    An example that is not usable contributes exactly zero anyway; zeroing its inputs first keeps
    its values out of every batched operation. Some lowerings mix rows of a batched op (XLA
    expands a grouped or depthwise float64 convolution into a dense one with a zero-masked
    filter, where ``0 * NaN = NaN`` reaches every example), so a non-finite row could otherwise
    make other examples' norms non-finite and drop them: one example would change the others'
    contributions."""
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    usable = tf.convert_to_tensor(valid)
    for t in tf.nest.flatten(x):
        if t.dtype.is_floating:
            usable = tf.logical_and(usable, tf.reduce_all(tf.math.is_finite(
                tf.reshape(t, tf.stack([tf.shape(t)[0], -1]))), axis=1))

    def zeroed(t):
        if not t.dtype.is_floating:
            return t
        return tf.where(tf.reshape(usable, [-1] + [1] * (t.shape.rank - 1)), t, tf.zeros_like(t))

    return tf.nest.map_structure(zeroed, x), usable


def _owned_weights(layer) -> list[tf.Variable]:
    return owned_variables(layer)


def _units(model: tf.keras.Model) -> list[tuple[tf.keras.layers.Layer, list[tf.Variable]]]:
    """``(layer, variables)`` for every layer a rule is planned for.

    A leaf layer that creates weights itself owns them; a recurrent layer owns the weights of its
    cell (and of the cells inside it), which its call uses without calling the cell's ``call``
    (:mod:`sparta_tf.per_example.rules.recurrent`). A layer with weights of its own *and* sublayers with
    weights is a unit too; the planner refuses it.
    """
    units, claimed = [], set()
    for module in all_layers(model):
        if id(module) in claimed:
            continue
        if is_recurrent(module):
            cells = cell_layers(module)
            claimed.update(id(c) for c in cells)
            units.append((module, [v for c in cells for v in _owned_weights(c)]))
        elif _owned_weights(module):
            units.append((module, _owned_weights(module)))
    return units


def _layers_inside_time_distributed(model: tf.keras.Model) -> tuple[list, set[int]]:
    """``(wrappers, ids of the layers they apply to [B*T, ...] rows)``."""
    wrappers = [m for m in all_layers(model)
                if isinstance(m, tf.keras.layers.TimeDistributed)]
    inside = {id(layer) for w in wrappers for layer in [w.layer, *all_layers(w.layer)]}
    return wrappers, inside


class HookedEngine:
    """An engine that records layer inputs and output gradients through per-layer hooks.

    ``plan``: ``[(layer, rule, [indices into selections])]``; each rule's ``probe_point`` says
    where its layer is probed (see :mod:`sparta_tf.per_example.recording`). Layers inside a
    ``TimeDistributed`` see ``B*T`` rows; their per-row gradients are summed per example
    (:func:`per_example_sum`).
    """

    def __init__(self, model: tf.keras.Model, selections: Sequence[VariableSelection], plan):
        self.model = model
        self.selections = list(selections)
        self.plan = plan
        wrappers, self._grouped = _layers_inside_time_distributed(model)
        for wrapper in wrappers:
            install_reshape_hook(wrapper)
        for layer, rule, _ in plan:
            install_hook(layer, rule)
        self.layers = [layer for layer, _, _ in plan]

    def is_grouped(self, layer) -> bool:
        """True for a layer that a ``TimeDistributed`` applies to several rows per example."""
        return id(layer) in self._grouped


class LayerwiseEngine(HookedEngine):
    """Per-example gradients from layer inputs and output gradients (see module doc)."""

    name = "layerwise"

    @classmethod
    def plan_for(cls, model: tf.keras.Model, selections: Sequence[VariableSelection], rule_of=rule_for):
        """(plan, None) when every selected variable is covered, else (None, reason).

        ``plan``: ``[(layer, rule_of(layer), [indices of the layer's selections])]``. Raises
        :class:`UnsupportedLayerError` for a layer no engine can make exact (e.g. a stateful RNN).
        """
        variables = [s.variable for s in selections]
        index_of = {id(v): k for k, v in enumerate(variables)}
        covered: set[int] = set()
        plan = []
        for layer, owned in _units(model):
            wanted = [index_of[id(v)] for v in owned if id(v) in index_of]
            if not wanted:
                continue
            if is_recurrent(layer):
                check_recurrent_layer(layer)
                plan.append((layer, rule_of(layer), wanted))
                covered.update(wanted)
                continue
            sublayers_with_weights = [
                sub for sub in all_layers(layer)
                if _owned_weights(sub)
            ]
            if sublayers_with_weights:
                return None, f"layer {layer.name!r} owns weights and has sublayers with weights"
            plan.append((layer, rule_of(layer), wanted))
            covered.update(wanted)
        missing = [variables[k].name for k in range(len(variables)) if k not in covered]
        if missing:
            return None, f"variables not owned by a layer: {missing[:3]}"
        return plan, None

    def __call__(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor) -> PerExampleGradients:
        return self._per_example(record_output_gradients(self.model, self.layers, x, y, loss_fn, valid))

    def coverage_sums(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor):
        """``(sum_i g_i, the batch gradient of the same pass)`` per selection (see
        :func:`sparta_tf.per_example.coverage.check_coverage`)."""
        recorded = record_output_gradients(self.model, self.layers, x, y, loss_fn, valid,
                                           watch=[s.variable for s in self.selections])
        result = self._per_example(recorded)
        return [tf.reduce_sum(g, axis=0) for g in result.grads], recorded.batch_gradients

    def _per_example(self, recorded: RecordedPass) -> PerExampleGradients:
        per_layer_calls, losses = recorded.calls, recorded.losses
        batch = tf.shape(losses)[0]
        grads: list = [None] * len(self.selections)
        for layer, rule, indices in self.plan:
            selections = [self.selections[k] for k in indices]
            for call, delta in per_layer_calls.get(id(layer), []):
                if delta is None:
                    continue
                call_grads = rule.per_example_grads(layer, call, delta, selections)
                if self.is_grouped(layer):
                    call_grads = [per_example_sum(g, batch) for g in call_grads]
                else:
                    check_rows(layer, call_grads[0], losses)
                for k, g in zip(indices, call_grads):
                    grads[k] = g if grads[k] is None else grads[k] + g
        grads = [
            tf.zeros(tf.concat([[batch], s.compact_shape], 0), accumulation_dtype(s.variable.dtype))
            if g is None else g
            for g, s in zip(grads, self.selections)
        ]
        return PerExampleGradients(grads, losses, recorded.predictions, recorded.valid)


def per_example_sum(rows: tf.Tensor, batch: tf.Tensor) -> tf.Tensor:
    """``[B*T, ...] -> [B, ...]``: per-row gradients of a layer inside ``TimeDistributed`` summed per
    example (row ``i*T + t`` is example ``i``'s step ``t``, the order of Keras's reshape)."""
    grouped = tf.reshape(rows, tf.concat([[batch, -1], tf.shape(rows)[1:]], 0))
    summed = tf.reduce_sum(grouped, axis=1)
    if rows.shape.rank is not None:
        summed.set_shape([None, *rows.shape[1:]])
    return summed


def check_rows(layer, per_example: tf.Tensor, losses: tf.Tensor) -> None:
    """Refuses a layer whose call saw another number of rows than the batch's examples (a reshape
    that folds examples together outside ``TimeDistributed``): its per-row norms are not per example."""
    rows, batch = per_example.shape[0], losses.shape[0]
    if rows is not None and batch is not None and rows != batch:
        raise UnsupportedLayerError(
            f"layer {layer.name!r} was called on {rows} rows for a batch of {batch} examples (a reshape folds "
            "examples together), so its per-row gradients are not per-example ones; apply it with "
            "tf.keras.layers.TimeDistributed, or keep the batch axis first")


def record_output_gradients(model, layers, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor, watch=()) -> RecordedPass:
    """One batched forward and one batched backward pass of ``sum_i valid_i L_i``.

    Returns the :class:`RecordedPass`: per layer its calls and ``delta = [dL_1/dz_1, ...,
    dL_B/dz_B]`` at each call's probe point (no layer mixes examples, so the gradient of the sum
    separates by example), in the accumulation dtype (float32 for bfloat16 / float16 layers;
    :func:`sparta_tf.precision.accumulation_dtype`), None for a call the loss does not depend
    on; the losses; the predictions; the usable examples (:func:`finite_rows`, whose zeroed
    inputs the pass ran on). With ``watch`` (variables), also their batch gradients of the same pass.
    """
    x, valid = finite_rows(x, valid)
    watch = [tf_variable(v) for v in watch]
    with tf.GradientTape(watch_accessed_variables=False, persistent=False) as tape:
        tape.watch(list(watch))
        with recording(tape, layers) as rec:
            predictions = model(x, training=True)
        losses = loss_fn(y, predictions)
        total = tf.reduce_sum(tf.where(valid, losses, tf.zeros_like(losses)))
    sources = [call.probe for call in rec.calls]
    gradients = tape.gradient(total, sources + list(watch))
    deltas, variable_grads = gradients[: len(sources)], gradients[len(sources):]
    per_layer_calls: dict[int, list] = {}
    for call, delta in zip(rec.calls, deltas):
        per_layer_calls.setdefault(id(call.layer), []).append((call, _accumulation_delta(call.probe, delta)))
    return RecordedPass(per_layer_calls, losses, predictions, valid, list(variable_grads))


def _accumulation_delta(probe, delta):
    """``delta`` cast to the accumulation dtype; None when no part of the probe reaches the loss,
    zeros for the parts that do not (a structure of probes)."""
    if all(d is None for d in tf.nest.flatten(delta)):
        return None
    return tf.nest.map_structure(
        lambda p, d: to_accumulation(tf.zeros_like(p) if d is None else tf.convert_to_tensor(d)), probe, delta)


class VectorizedEngine:
    """``tf.vectorized_map`` over examples of the gradient of a batch-of-one loss."""

    name = "vectorized"

    def __init__(self, model: tf.keras.Model, selections: Sequence[VariableSelection]):
        recurrent = [layer.name for layer in all_layers(model)
                     if is_recurrent(layer)]
        if recurrent:
            raise UnsupportedLayerError(
                f"engine='vectorized' cannot take per-example gradients through the recurrent layer "
                f"{recurrent[0]!r} (tf.vectorized_map has no rule for its while loop); use engine='auto' "
                "or 'layerwise'")
        self.model = model
        self.selections = list(selections)
        self.variables = [tf_variable(s.variable) for s in self.selections]

    def __call__(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor) -> PerExampleGradients:
        x, valid = finite_rows(x, valid)  # padding is removed by the clipping step

        def one_example(example):
            x_i, y_i = tf.nest.map_structure(lambda t: t[None], example)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(self.variables)
                prediction = self.model(x_i, training=True)
                loss = loss_fn(y_i, prediction)[0]
            grads = tape.gradient(
                loss, self.variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            grads = [to_accumulation(tf.convert_to_tensor(g)) for g in grads]
            prediction = tf.nest.map_structure(lambda t: t[0], prediction)
            return grads, loss, prediction

        grads, losses, predictions = tf.vectorized_map(one_example, (x, y))
        grads = [s.compact(g, batch_dims=1) for s, g in zip(self.selections, grads)]
        return PerExampleGradients(grads, losses, predictions, valid)
