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

With ``views = K > 1`` (augmentation multiplicity, :mod:`sparta_tf.dp_step.views`) an example is
``K`` consecutive rows of ``x`` and ``y`` (row ``i K + k``: view ``k`` of example ``i``) and
``valid`` has one entry per example: every engine computes ``g_i = (1/K) sum_k grad L(v_ik)``,
the gradient of the mean loss over the example's views (the layer-wise rules see ``K B`` rows and
sum each example's rows, as for ``TimeDistributed``), and returns one loss (the mean) per example.

:func:`~sparta_tf.per_example.factory.make_engine` picks the engine.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import tensorflow as tf

from sparta_tf.backend import owned_variables, tf_variable
from sparta_tf.example_rows import keep_examples
from sparta_tf.keras_layers import all_layers
from sparta_tf.per_example.errors import UnsupportedLayerError
from sparta_tf.per_example.grouped_conv import substitute_grouped_convolutions, vectorizable_convolutions
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


def finite_rows(x, valid: tf.Tensor, views: int = 1):
    """``(x, usable)``: ``usable = valid`` and every floating-point input of the example finite;
    the inputs of examples that are not usable (padding, NaN or inf) set to zero. With ``views = K``
    an example is ``K`` consecutive rows of ``x`` (``valid``: one per example), usable when all
    its rows are.

    An example that is not usable contributes exactly zero anyway; zeroing its inputs first keeps
    its values out of every batched operation. Some lowerings mix rows of a batched op (XLA
    expands a grouped or depthwise float64 convolution into a dense one with a zero-masked
    filter, where ``0 * NaN = NaN`` reaches every example), so a non-finite row could otherwise
    make other examples' norms non-finite and drop them: one example would change the others'
    contributions."""
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    usable = view_rows(tf.convert_to_tensor(valid), views)
    for t in tf.nest.flatten(x):
        if t.dtype.is_floating:
            usable = tf.logical_and(usable, tf.reduce_all(tf.math.is_finite(
                tf.reshape(t, tf.stack([tf.shape(t)[0], -1]))), axis=1))
    if views > 1:
        usable = tf.reduce_all(tf.reshape(usable, [-1, views]), axis=1)
    rows = view_rows(usable, views)

    def zeroed(t):
        if not t.dtype.is_floating:
            return t
        return keep_examples(t, rows)

    return tf.nest.map_structure(zeroed, x), usable


def view_rows(per_example: tf.Tensor, views: int) -> tf.Tensor:
    """``[B, ...] -> [K B, ...]``: each example's entry repeated over its ``K`` view rows."""
    return per_example if views == 1 else tf.repeat(per_example, views, axis=0)


def example_mean(per_row: tf.Tensor, views: int) -> tf.Tensor:
    """``[K B] -> [B]``: the mean over each example's ``K`` view rows."""
    return per_row if views == 1 else tf.reduce_mean(tf.reshape(per_row, [-1, views]), axis=1)


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

    def __init__(self, model: tf.keras.Model, selections: Sequence[VariableSelection], plan, views: int = 1):
        self.model = model
        self.selections = list(selections)
        self.plan = plan
        self.views = views
        wrappers, self._grouped = _layers_inside_time_distributed(model)
        for wrapper in wrappers:
            install_reshape_hook(wrapper)
        for layer, rule, _ in plan:
            install_hook(layer, rule)
        self.layers = [layer for layer, _, _ in plan]

    def is_grouped(self, layer) -> bool:
        """True for a layer that sees several rows per example: the views of augmentation
        multiplicity, or a ``TimeDistributed`` around it."""
        return self.views > 1 or id(layer) in self._grouped

    def record(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor, watch=()) -> "RecordedPass":
        """:func:`record_output_gradients` of the engine's layers (and views)."""
        return record_output_gradients(self.model, self.layers, x, y, loss_fn, valid, watch=watch, views=self.views)


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
        return self._per_example(self.record(x, y, loss_fn, valid))

    def coverage_sums(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor):
        """``(sum_i g_i, the batch gradient of the same pass)`` per selection (see
        :func:`sparta_tf.per_example.coverage.check_coverage`)."""
        recorded = self.record(x, y, loss_fn, valid, watch=[s.variable for s in self.selections])
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
                if id(layer) not in self._grouped:  # not inside TimeDistributed: one row per view
                    check_rows(layer, call_grads[0], losses, self.views)
                if self.is_grouped(layer):
                    call_grads = [per_example_sum(g, batch) for g in call_grads]
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


def check_rows(layer, per_example: tf.Tensor, losses: tf.Tensor, views: int = 1) -> None:
    """Refuses a layer whose call saw another number of rows than the batch's examples (times their
    ``views``) (a reshape that folds examples together outside ``TimeDistributed``): its per-row
    norms are not per example."""
    rows, batch = per_example.shape[0], losses.shape[0]
    if rows is not None and batch is not None and rows != batch * views:
        raise UnsupportedLayerError(
            f"layer {layer.name!r} was called on {rows} rows for a batch of {batch * views} rows (a reshape folds "
            "examples together), so its per-row gradients are not per-example ones; apply it with "
            "tf.keras.layers.TimeDistributed, or keep the batch axis first")


def record_output_gradients(model, layers, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor, watch=(),
                            views: int = 1) -> RecordedPass:
    """One batched forward and one batched backward pass of ``sum_i valid_i L_i``
    (``views = K > 1``: ``L_i = (1/K) sum_k L(v_ik)`` over the example's ``K`` view rows).

    Returns the :class:`RecordedPass`: per layer its calls and ``delta = [dL_1/dz_1, ...,
    dL_B/dz_B]`` at each call's probe point (no layer mixes examples, so the gradient of the sum
    separates by example), in the accumulation dtype (float32 for bfloat16 / float16 layers;
    :func:`sparta_tf.precision.accumulation_dtype`), None for a call the loss does not depend
    on; the losses; the predictions; the usable examples (:func:`finite_rows`, whose zeroed
    inputs the pass ran on). With ``watch`` (variables), also their batch gradients of the same pass.
    """
    x, valid = finite_rows(x, valid, views)
    watch = [tf_variable(v) for v in watch]
    with tf.GradientTape(watch_accessed_variables=False, persistent=False) as tape:
        tape.watch(list(watch))
        with recording(tape, layers) as rec:
            predictions = model(x, training=True)
        losses = loss_fn(y, predictions)
        total = tf.reduce_sum(tf.where(view_rows(valid, views), losses, tf.zeros_like(losses)))
        if views > 1:
            total = total / tf.cast(views, total.dtype)
    losses = example_mean(losses, views)
    sources = [call.probe for call in rec.calls]
    gradients = tape.gradient(total, sources + list(watch))
    deltas, variable_grads = gradients[: len(sources)], gradients[len(sources):]
    per_layer_calls: dict[int, list] = {}
    for call, delta in zip(rec.calls, deltas):
        per_layer_calls.setdefault(id(call.layer), []).append((call, accumulation_delta(call.probe, delta)))
    return RecordedPass(per_layer_calls, losses, predictions, valid, list(variable_grads))


def accumulation_delta(probe, delta):
    """``delta`` cast to the accumulation dtype; None when no part of the probe reaches the loss,
    zeros for the parts that do not (a structure of probes)."""
    if all(d is None for d in tf.nest.flatten(delta)):
        return None
    return tf.nest.map_structure(
        lambda p, d: to_accumulation(tf.zeros_like(p) if d is None else tf.convert_to_tensor(d)), probe, delta)


class VectorizedEngine:
    """``tf.vectorized_map`` over examples of the gradient of a batch-of-one loss. Grouped
    convolutions whose per-example gradients TensorFlow's own kernels cannot take (oneDNN off;
    Conv3D) run as one convolution by the block-diagonal kernel there
    (:mod:`~sparta_tf.per_example.grouped_conv`)."""

    name = "vectorized"

    def __init__(self, model: tf.keras.Model, selections: Sequence[VariableSelection], views: int = 1):
        recurrent = [layer.name for layer in all_layers(model)
                     if is_recurrent(layer)]
        if recurrent:
            raise UnsupportedLayerError(
                f"engine='vectorized' cannot take per-example gradients through the recurrent layer "
                f"{recurrent[0]!r} (tf.vectorized_map has no rule for its while loop); use engine='auto' "
                "or 'layerwise'")
        substitute_grouped_convolutions(all_layers(model))
        self.model = model
        self.selections = list(selections)
        self.variables = [tf_variable(s.variable) for s in self.selections]
        self.views = views

    def __call__(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor) -> PerExampleGradients:
        x, valid = finite_rows(x, valid, self.views)  # padding is removed by the clipping step
        views = self.views

        def one_example(example):
            # an example: a batch of one row, or of its K view rows (whose mean loss it takes)
            x_i, y_i = example if views > 1 else tf.nest.map_structure(lambda t: t[None], example)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(self.variables)
                prediction = self.model(x_i, training=True)
                loss = tf.reduce_mean(loss_fn(y_i, prediction)) if views > 1 else loss_fn(y_i, prediction)[0]
            grads = tape.gradient(
                loss, self.variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            grads = [to_accumulation(tf.convert_to_tensor(g)) for g in grads]
            if views == 1:
                prediction = tf.nest.map_structure(lambda t: t[0], prediction)
            return grads, loss, prediction

        examples = (x, y) if views == 1 else tf.nest.map_structure(lambda t: _by_example(t, views), (x, y))
        with vectorizable_convolutions():
            grads, losses, predictions = tf.vectorized_map(one_example, examples)
        if views > 1:
            predictions = tf.nest.map_structure(_by_row, predictions)
        grads = [s.compact(g, batch_dims=1) for s, g in zip(self.selections, grads)]
        return PerExampleGradients(grads, losses, predictions, valid)


def _by_example(rows: tf.Tensor, views: int) -> tf.Tensor:
    """``[K B, ...] -> [B, K, ...]``."""
    return tf.reshape(rows, tf.concat([[-1, views], tf.shape(rows)[1:]], 0))


def _by_row(grouped: tf.Tensor) -> tf.Tensor:
    """``[B, K, ...] -> [K B, ...]``."""
    return tf.reshape(grouped, tf.concat([[-1], tf.shape(grouped)[2:]], 0))
