"""Taps: each layer's norms (and clipped sums) computed inside the backward pass.

Every layer's output carries a *tap*, an identity whose gradient function receives the layer's
output gradient ``delta`` as the backward pass reaches the layer; ``delta`` itself flows on and is
freed once the layers below have it. The one-pass book-keeping step
(:mod:`~sparta_tf.per_example.bookkeeping`) computes the layer's part of ``||g_i||^2`` there and
keeps for the clipped sum the smaller of ``delta`` and the layer's per-example gradients
(:func:`smaller_to_keep`; the tap's gradient function leaves them in
``Streaming.kept_for_sums``, tensors of the step's own graph, read once the backward pass is
built). The two-pass step (Lee & Kifer 2021; Bu et al. 2022's mixed ghost
clipping) keeps neither:

1. **norm pass**: a backward pass of ``sum_i L_i``. Each tap computes the layer's part of
   ``||g_i||^2`` with the layer's rule (rank one, ghost or direct) and hands it out as the
   gradient of a ``[B]`` *norm sink*;
2. the clip factors ``c_i = min(1, C/||g_i||)`` (0 for examples not kept);
3. **sum pass**: a second backward pass, of ``sum_i k_i L_i`` with ``k_i`` 1 for the examples kept
   and 0 for the others (the forward pass is shared, on a persistent tape): the norm pass's
   computation again, so each layer's tap receives the same ``delta`` (rows of examples not kept
   set to exactly zero at every tap, so that ``0 * nan`` from an overflowed example cannot reach
   the others). The tap scales it by ``c`` in the accumulation dtype, as the one-pass step does,
   computes the layer's ``S^l = sum_i c_i g_i^l`` with the rule's ``weighted_sums`` and hands it
   out as the gradient of a *sum sink* of the selection's compact shape. Scaling at the tap, not
   by weighting the loss, keeps ``c`` out of the backward pass's own arithmetic: under mixed
   precision a float16 backward pass of ``sum_i c_i L_i`` would round ``c_i delta_i`` and a
   contribution could exceed ``C`` by the float16 rounding.

The result equals the one-pass step's up to rounding, at the price of one more backward pass to
the layer outputs. A layer whose output gradient cannot be tapped (called more than once, several
rows per view inside ``TimeDistributed``, a structured output) keeps its output gradient as in the
one-pass step. With augmentation multiplicity an example's ``K`` view rows are one *unit*
(:mod:`~sparta_tf.per_example.units`): each tap computes the layer's part of ``||g_u||^2`` per
unit (:meth:`~sparta_tf.per_example.rules.base.GhostRule.unit_squared_norms`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import tensorflow as tf

from sparta_tf.example_rows import keep_examples
from sparta_tf.per_example.engines import check_rows
from sparta_tf.per_example.memory_budget import GRADIENTS_OVER_DELTA
from sparta_tf.per_example.rules.base import GhostRule
from sparta_tf.per_example.units import ONE_ROW, Units
from sparta_tf.precision import accumulation_dtype, is_low_precision, to_accumulation

NORMS, SUMS = "norms", "sums"


class Tap(NamedTuple):
    """The sinks of one tapped layer call: their gradients are the layer's norms and sums."""

    norm_sink: tf.Tensor  # [B] (one per unit)
    sum_sinks: list  # one per selection of the layer, compact shape (none in a one-pass step)


class KeptForSums(NamedTuple):
    """What a one-pass step's tap keeps of its layer for the clipped sums: the per-example gradients
    ``{position: [B, *compact]}`` when its rule materialised every selection's and they take at most
    :data:`GRADIENTS_OVER_DELTA` times the output gradient ``delta``'s memory, else ``delta``
    (accumulation dtype)."""

    grads: dict | None
    delta: tf.Tensor | None


def smaller_to_keep(delta: tf.Tensor, materialised: dict, selections: int, low_precision: bool = False) -> KeptForSums:
    """The per-example gradients where the rule materialised all ``selections`` of the layer and
    they are at most :data:`GRADIENTS_OVER_DELTA` times ``delta``'s bytes (e.g. a 3x3 convolution
    on a 32x32 map: 1.2 MB against 8 MB at ``B = 128``), else ``delta`` (the same layer on an 8x8
    map with 64 channels: 18 MB of per-example gradients against 2 MB).

    ``low_precision`` (the layer's output is bfloat16 or float16): the materialised gradients
    whatever their size. From ``delta`` the sums would re-run the materialising rule on ``c * delta``,
    which is rounded back to the layer's dtype and computed in it: ``g(round(c delta))`` is not
    ``c g(delta)``, whose norm was clipped (measured: 1.0014 C in bfloat16 for a layer of the
    generic per-example VJP rule)."""
    if len(materialised) == selections:
        sizes = [tensor_bytes(g) for g in materialised.values()]
        delta_size = tensor_bytes(delta)
        small = None not in sizes and delta_size is not None and sum(sizes) <= GRADIENTS_OVER_DELTA * delta_size
        if small or (low_precision and materialised):
            return KeptForSums(dict(materialised), None)
    return KeptForSums(None, delta)


class Streaming:
    """The taps of one recording pass, and which backward pass is being built.

    ``rules``: ``{id(layer): (GhostRule, [selections])}`` for the layers that may be tapped (one row
    per example). ``mode`` is read when TensorFlow builds a backward pass (a tap's gradient function
    runs then): :data:`NORMS`, :data:`SUMS` (with ``keep`` and the clip ``factors`` set) or None (a
    tap only passes ``delta`` on); only the taps of the ``streamed`` calls compute norms and sums
    (in the sum pass every tap zeroes the rows of examples not kept).

    ``units``: the rows clipped as one (:mod:`~sparta_tf.per_example.units`; an example's views): a
    tap's norms are per unit (its norm sink ``[U]``), and ``keep`` and ``factors`` of the sum pass
    are per row (each unit's repeated over its rows)."""

    def __init__(self, rules: dict, sum_sinks: bool = True, units: Units = ONE_ROW):
        self.rules = rules
        self.units = units
        self.sum_sinks = sum_sinks  # False: a one-pass step, whose taps hand out no sums
        self.mode: str | None = None
        self.keep: tf.Tensor | None = None
        self.factors: tf.Tensor | None = None
        self.streamed: set[int] = set()  # ids of the calls whose taps compute norms and sums
        self.batch_rows: tf.Tensor | None = None
        self.methods: list = []
        self.materialised: dict = {}  # id(call) -> positions whose norms the rule materialised (either pass)
        self.keep_for_sums = False  # one pass: each tap keeps what its layer's sums need
        self.kept_for_sums: dict = {}  # id(call) -> KeptForSums

    def kept_bytes(self) -> int | None:
        """What the taps of a one-pass step keep for the sums (None where a shape is unknown)."""
        sizes = [tensor_bytes(t) for kept in self.kept_for_sums.values()
                 for t in ([kept.delta] if kept.grads is None else kept.grads.values())]
        return None if None in sizes else sum(sizes)

    def tap(self, recording, call, output: tf.Tensor) -> tf.Tensor:
        """``output`` through a tap whose sinks are recorded on ``call.tap``."""
        rule, selections = self.rules[id(call.layer)]
        units = tf.shape(output)[:1] if self.units.rows == 1 else [self.units.units_of(tf.shape(output)[0])]
        norm_sink = tf.zeros(units, accumulation_dtype(output.dtype))
        sum_sinks = [tf.zeros(s.compact_shape, accumulation_dtype(s.variable.dtype))
                     for s in (selections if self.sum_sinks else [])]  # each the size of its variable
        recording.tape.watch([norm_sink, *sum_sinks])
        call.tap = Tap(norm_sink, sum_sinks)

        @tf.custom_gradient
        def tapped(z, norm, *sums):
            def backward(dz):
                return self._backward(call, rule, selections, dz, norm, sums)
            return tf.identity(z), backward

        return tapped(output, norm_sink, *sum_sinks)

    def _backward(self, call, rule, selections, dz, norm_sink, sum_sinks):
        """The tap's gradients: ``(delta passed on, this layer's norms, its sums)``."""
        streamed = id(call) in self.streamed
        if self.mode == NORMS and streamed:
            materialised: dict = {}  # position -> per-example gradients (two passes: only the positions kept)
            with tf.control_dependencies([dz]):  # not before the backward pass reaches this layer
                delta = to_accumulation(dz)
                norms, methods = rule.unit_squared_norms(call.layer, call, delta, selections, self.units, materialised)
            self.materialised[id(call)] = set(materialised)
            kept = "streamed"
            if self.keep_for_sums:
                self.kept_for_sums[id(call)] = smaller_to_keep(delta, materialised, len(selections),
                                                               is_low_precision(dz))
                kept = "kept" if self.kept_for_sums[id(call)].grads is None else "per_example"
            if self.batch_rows is not None:
                check_rows(call.layer, norms, self.batch_rows)
            self.methods.extend(method._replace(output_gradient=kept) for method in methods)
            return (dz, tf.cast(norms, norm_sink.dtype), *[tf.zeros_like(s) for s in sum_sinks])
        if self.mode == SUMS:
            passed_on = keep_examples(dz, self.keep)
            if not streamed:
                return (passed_on, tf.zeros_like(norm_sink), *[tf.zeros_like(s) for s in sum_sinks])
            delta = to_accumulation(passed_on)
            delta_c = delta * tf.reshape(tf.cast(self.factors, delta.dtype), [-1] + [1] * (delta.shape.rank - 1))
            with tf.control_dependencies([delta_c]):
                sums = layer_sums(rule, call, delta_c, self.keep, selections, self.materialised.get(id(call), set()))
            return (passed_on, tf.zeros_like(norm_sink),
                    *[tf.reshape(tf.cast(s, sink.dtype), sink.shape) for s, sink in zip(sums, sum_sinks)])
        return (dz, tf.zeros_like(norm_sink), *[tf.zeros_like(s) for s in sum_sinks])


def layer_sums(rule, call, delta_c, keep, selections, materialised: set) -> list:
    """``sum_i c_i g_i`` for each of a layer's ``selections``: by the rule's ``weighted_sums`` where it
    takes any selection, else by it for the selections whose norms it factorised and by the
    per-example gradients of ``c * delta`` summed (:meth:`GhostRule.weighted_sums`) for those it
    materialised (positions in ``materialised``)."""
    if rule.sums_any_selection or not materialised:
        return rule.weighted_sums(call.layer, call, delta_c, keep, selections)
    sums: list = [None] * len(selections)
    for positions, weighted_sums in (([k for k in range(len(selections)) if k not in materialised], rule.weighted_sums),
                                     (sorted(materialised), functools.partial(GhostRule.weighted_sums, rule))):
        if positions:
            for k, total in zip(positions, weighted_sums(call.layer, call, delta_c, keep,
                                                         [selections[k] for k in positions])):
                sums[k] = total
    return sums


def tensor_bytes(t) -> int | None:
    """Bytes of a tensor of static shape (None when unknown when the step is traced)."""
    if not isinstance(t, tf.Tensor) or not t.shape.is_fully_defined():
        return None
    return t.shape.num_elements() * t.dtype.size


def kept_bytes(calls: Sequence) -> int | None:
    """What the one-pass step keeps until the clip factors are known: every recorded call's output
    gradient, ``sum_calls bytes(delta)`` (None when a shape is unknown when the step is traced)."""
    total = 0
    for call in calls:
        for probe in tf.nest.flatten(call.probe):
            size = tensor_bytes(probe)
            if size is None:
                return None
            total += size
    return total
