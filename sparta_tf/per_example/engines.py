"""Per-example gradient engines.

An engine is built for a trainable set (:mod:`sparta_tf.trainable`; a plain
list of variables means "all of each") and maps a batch ``(x, y)`` and a
per-example loss to

* ``grads[k]``: ``[B, *compact_shape_k]``, the gradient of ``L_i`` w.r.t. the
  trainable coordinates of selection ``k`` for every example ``i``;
* ``losses``: ``[B]`` per-example losses ``L_i``;
* ``predictions``: the model output on the batch (for metrics).

Two engines compute the same quantity:

* :class:`LayerwiseEngine` ("book-keeping"): one batched forward and one
  batched backward pass to the layer outputs, then a per-layer rule turns
  layer inputs and output gradients into per-example weight gradients
  (:mod:`sparta_tf.per_example.layer_rules`). Used when every variable asked
  for belongs to a layer that owns it directly.
* :class:`VectorizedEngine`: ``tf.vectorized_map`` over examples of the
  gradient of a batch-of-one forward pass. Works for any Keras model.

:func:`make_engine` picks the layer-wise engine when it covers the variables
and says why it falls back otherwise.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Sequence

import tensorflow as tf

from sparta_tf.per_example.layer_rules import LayerRule, rule_for
from sparta_tf.per_example.recording import install_hook, recording
from sparta_tf.trainable import TrainableSet, VariableSelection

logger = logging.getLogger(__name__)

PerExampleLoss = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


class PerExampleGradients(NamedTuple):
    grads: list  # [B, *variable.shape] per variable
    losses: tf.Tensor  # [B]
    predictions: object  # model output structure


def _leaf_layers_owning_variables(model: tf.keras.Model) -> list[tf.keras.layers.Layer]:
    """Layers (including nested ones) that create trainable or frozen weights themselves."""
    layers = []
    for module in model._flatten_layers(include_self=False, recursive=True):
        own = list(module._trainable_weights) + list(module._non_trainable_weights)
        if own:
            layers.append(module)
    return layers


def _owned_weights(layer) -> list[tf.Variable]:
    return list(layer._trainable_weights) + list(layer._non_trainable_weights)


class HookedEngine:
    """An engine that records layer inputs and output gradients through per-layer hooks.

    ``plan``: ``[(layer, rule, [indices into selections])]``; each rule's ``probe_point`` says
    where its layer is probed (see :mod:`sparta_tf.per_example.recording`).
    """

    def __init__(self, model: tf.keras.Model, selections: Sequence[VariableSelection], plan):
        self.model = model
        self.selections = list(selections)
        self._plan = plan
        for layer, rule, _ in plan:
            install_hook(layer, rule)
        self._layers = [layer for layer, _, _ in plan]


class LayerwiseEngine(HookedEngine):
    """Per-example gradients from layer inputs and output gradients (see module doc)."""

    name = "layerwise"

    @classmethod
    def plan_for(cls, model: tf.keras.Model, selections: Sequence[VariableSelection], rule_of=rule_for):
        """(plan, None) when every selected variable is covered, else (None, reason).

        ``plan``: ``[(layer, rule_of(layer), [indices of the layer's selections])]``."""
        variables = [s.variable for s in selections]
        index_of = {id(v): k for k, v in enumerate(variables)}
        covered: set[int] = set()
        plan = []
        for layer in _leaf_layers_owning_variables(model):
            wanted = [index_of[id(v)] for v in _owned_weights(layer) if id(v) in index_of]
            if not wanted:
                continue
            sublayers_with_weights = [
                sub for sub in layer._flatten_layers(include_self=False, recursive=True)
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
        per_layer_calls, losses, predictions = record_output_gradients(self.model, self._layers, x, y, loss_fn, valid)
        grads: list = [None] * len(self.selections)
        for layer, rule, indices in self._plan:
            selections = [self.selections[k] for k in indices]
            for call, delta in per_layer_calls.get(id(layer), []):
                if delta is None:
                    continue
                for k, g in zip(indices, rule.per_example_grads(layer, call, delta, selections)):
                    grads[k] = g if grads[k] is None else grads[k] + g
        batch = tf.shape(losses)[0]
        grads = [
            tf.zeros(tf.concat([[batch], s.compact_shape], 0), s.variable.dtype) if g is None else g
            for g, s in zip(grads, self.selections)
        ]
        return PerExampleGradients(grads, losses, predictions)


def record_output_gradients(model, layers, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor):
    """One batched forward and one batched backward pass of ``sum_i valid_i L_i``.

    Returns ``({id(layer): [(RecordedCall, delta)]}, losses [B], predictions)``, where
    ``delta = [dL_1/dz_1, ..., dL_B/dz_B]`` at each call's probe point (no layer mixes
    examples, so the gradient of the sum separates by example); ``delta`` is None for a
    call the loss does not depend on.
    """
    with tf.GradientTape(watch_accessed_variables=False, persistent=False) as tape:
        with recording(tape, layers) as rec:
            predictions = model(x, training=True)
        losses = loss_fn(y, predictions)
        total = tf.reduce_sum(tf.where(valid, losses, tf.zeros_like(losses)))
    deltas = tape.gradient(total, [call.probe for call in rec.calls])
    per_layer_calls: dict[int, list] = {}
    for call, delta in zip(rec.calls, deltas):
        per_layer_calls.setdefault(id(call.layer), []).append((call, delta))
    return per_layer_calls, losses, predictions


class VectorizedEngine:
    """``tf.vectorized_map`` over examples of the gradient of a batch-of-one loss."""

    name = "vectorized"

    def __init__(self, model: tf.keras.Model, selections: Sequence[VariableSelection]):
        self.model = model
        self.selections = list(selections)
        self.variables = [s.variable for s in self.selections]

    def __call__(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor) -> PerExampleGradients:
        del valid  # padding is removed by the clipping step

        def one_example(example):
            x_i, y_i = tf.nest.map_structure(lambda t: t[None], example)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(self.variables)
                prediction = self.model(x_i, training=True)
                loss = loss_fn(y_i, prediction)[0]
            grads = tape.gradient(
                loss, self.variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            prediction = tf.nest.map_structure(lambda t: t[0], prediction)
            return grads, loss, prediction

        grads, losses, predictions = tf.vectorized_map(one_example, (x, y))
        grads = [s.compact(g, batch_dims=1) for s, g in zip(self.selections, grads)]
        return PerExampleGradients(grads, losses, predictions)


def as_selections(trainable) -> list[VariableSelection]:
    """A TrainableSet, selections or plain variables (each whole) as a list of selections."""
    if isinstance(trainable, TrainableSet):
        return list(trainable.selections)
    return [t if isinstance(t, VariableSelection) else VariableSelection(t) for t in trainable]


def make_engine(model: tf.keras.Model, trainable, engine: str = "auto"):
    """The per-example gradient engine for the trainable set ``trainable`` of ``model``.

    ``trainable``: a :class:`~sparta_tf.trainable.TrainableSet`, a list of
    selections, or a list of variables (each trained whole).
    ``engine``: ``"auto"`` (layer-wise when possible), ``"layerwise"`` (error
    if impossible) or ``"vectorized"``.
    """
    selections = as_selections(trainable)
    if engine not in ("auto", "layerwise", "vectorized"):
        raise ValueError(f"engine={engine!r} is not one of 'auto', 'layerwise', 'vectorized'")
    if engine == "vectorized":
        return VectorizedEngine(model, selections)
    plan, reason = LayerwiseEngine.plan_for(model, selections)
    if plan is None:
        if engine == "layerwise":
            raise ValueError(f"engine='layerwise' cannot handle this model: {reason}; use engine='auto'")
        logger.warning("per-example gradients: using tf.vectorized_map (%s)", reason)
        return VectorizedEngine(model, selections)
    return LayerwiseEngine(model, selections, plan)
