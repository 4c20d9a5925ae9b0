"""The book-keeping DP engine: clipped sums of per-example gradients without materialising them.

One batched forward and one batched backward pass of ``sum_i L_i``; every hooked layer's output
goes through a *tap* (:mod:`~sparta_tf.per_example.streaming`), whose gradient function receives
the layer's output gradient ``delta`` as the backward pass reaches the layer. Then

1. per layer, at its tap, the per-example squared norms of its selected coordinates
   (rank one, ghost norm, or that layer's own per-example gradients, as the
   cost model of :mod:`~sparta_tf.per_example.rules.ghost_norms` decides), summed
   over layers: ``||g_i||^2 = sum_l ||g_i^l||^2``; the tap keeps for step 3 the layer's
   per-example gradients where the norm computed them and they are about ``delta``'s size or
   smaller (:data:`~sparta_tf.per_example.streaming.GRADIENTS_OVER_DELTA`), else ``delta``, and
   ``delta`` flows on down the backward pass;
2. the clip factors ``c_i = min(1, C/||g_i||)`` (0 for padding and non-finite
   norms; :func:`sparta_tf.dp_step.clipping.clip_factors`);
3. per layer, ``S^l = sum_i c_i g_i^l``: ``sum_i c_i g_i^l`` of the kept per-example gradients,
   or the layer's ordinary weight gradient with ``delta`` replaced by ``c * delta``, one
   batched op.

So one pass keeps, per layer, about the smaller of the two (ResNet-20-GN at ``B = 128``: the
allocator's peak 256 MiB against the Keras step's 200 MiB; keeping every ``delta`` until the
norms of all layers were known peaked at 471 MiB). When even that exceeds ``max_memory`` the
step runs in two backward passes and keeps neither (:mod:`~sparta_tf.per_example.streaming`).
Layers whose output cannot be tapped (called more than once, several rows per view inside
``TimeDistributed``, a structured output) keep ``delta`` from a zero probe added to their output
(:func:`~sparta_tf.per_example.engines.record_output_gradients`) and get their norms after the
backward pass, one layer at a time. With augmentation multiplicity (``views = K``) an example's
``K`` view rows are one unit (:mod:`~sparta_tf.per_example.units`): the norms are per unit (for a
linear map, over the unit's merged positions), and step 3 scales each row by its example's ``c_i``.

A layer called more than once in the forward pass has ``g_i = sum_calls g_i^call``,
whose norm is not the sum of the calls' norms: for such a layer the engine
materialises that layer's per-example gradients (summed over its calls) and
clips them directly, so the result stays exact.

:meth:`BookkeepingEngine.cost_table` lists, per selected variable, the norm
method and the cost model's numbers of the last traced step (also logged once).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import NamedTuple, Sequence

import tensorflow as tf

from sparta_tf.dp_step import clipping
from sparta_tf.backend import variable_key
from sparta_tf.per_example.engines import (
    HookedEngine,
    LayerwiseEngine,
    PerExampleLoss,
    RecordedPass,
    accumulation_delta,
    check_rows,
    example_mean,
    finite_rows,
    per_example_sum,
    view_rows,
)
from sparta_tf.per_example.memory_budget import MemoryPlan, default_memory_budget, one_pass_bound, output_gradient_bytes
from sparta_tf.per_example.recording import recording
from sparta_tf.per_example.streaming import NORMS, SUMS, Streaming, kept_bytes, layer_sums
from sparta_tf.per_example.registry import ghost_rule_for
from sparta_tf.per_example.rules.recurrent import is_recurrent
from sparta_tf.per_example.rules.base import NormMethod, keep_examples, squared_sum
from sparta_tf.per_example.units import view_units
from sparta_tf.precision import accumulation_dtype, is_low_precision, to_accumulation
from sparta_tf.trainable import VariableSelection

logger = logging.getLogger(__name__)


class ClippedBatch(NamedTuple):
    """One (micro-)batch's clipped sum and what the step reports."""

    sums: list  # sum_i c_i g_i per selection, compact shapes
    squared_norms: tf.Tensor  # [B] unclipped ||g_i||^2 over the selected coordinates
    losses: tf.Tensor  # [B]
    predictions: object
    kept: tf.Tensor  # [B] bool: the examples that contributed (real, finite input and norm)


class BookkeepingEngine(HookedEngine):
    """Per-example clipping by book-keeping (see module doc). ``plan``: ``[(layer, GhostRule, indices)]``."""

    name = "bookkeeping"

    def __init__(self, model: tf.keras.Model, selections: Sequence[VariableSelection], plan, views: int = 1,
                 max_memory: int | None = None):
        super().__init__(model, selections, plan, views)
        self.units = view_units(views)  # an example's view rows, clipped as one (sparta_tf.per_example.units)
        self.max_memory = default_memory_budget() if max_memory is None else int(max_memory)
        self._cost_table: list[NormMethod] = []
        self._memory_plan: MemoryPlan | None = None
        self._logged = False

    def cost_table(self) -> list[NormMethod]:
        """Per selected variable: how its per-example norms are computed (after a step was traced)."""
        return list(self._cost_table)

    def memory_plan(self) -> "MemoryPlan | None":
        """How the last traced step kept its output gradients (None before a step was traced)."""
        return self._memory_plan

    def clipped_sum(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor, clip_norm: float) -> ClippedBatch:
        """``sum_i c_i g_i`` of a (micro-)batch, ``c_i = min(1, C/||g_i||)`` (0 for padding).

        Every layer whose output can be tapped (:mod:`~sparta_tf.per_example.streaming`) computes
        its norms inside the backward pass, as the pass reaches it. One pass when what it keeps fits
        in ``max_memory`` bytes: each tapped layer then keeps the smaller of its output gradient and
        its per-example gradients for the clipped sum; else two passes, keeping neither."""
        one_pass = self._fits_in_one_pass(x)
        x, valid = finite_rows(x, valid, self.views)
        streaming = Streaming({id(layer): (rule, [self.selections[k] for k in indices])
                               for layer, rule, indices in self.plan if not self._time_distributed(layer)},
                              sum_sinks=not one_pass, units=self.units)
        with tf.GradientTape(watch_accessed_variables=False, persistent=not one_pass) as tape:
            with recording(tape, self.layers, streaming) as rec:
                predictions = self.model(x, training=True)
            row_losses = loss_fn(y, predictions)
            total = tf.reduce_sum(tf.where(view_rows(valid, self.views), row_losses, tf.zeros_like(row_losses)))
            if self.views > 1:  # an example's loss: the mean over its views
                total = total / tf.cast(self.views, total.dtype)
        losses = example_mean(row_losses, self.views)
        streamed, kept, one_pass = self._streamed_calls(rec.calls, one_pass)
        streaming.mode, streaming.batch_rows, streaming.streamed = NORMS, losses, {id(c) for c in streamed}
        streaming.keep_for_sums = one_pass
        gradients = tape.gradient(total, [c.tap.norm_sink for c in streamed] + [c.probe for c in kept])
        streaming.mode = None
        self._memory_plan = MemoryPlan("one_pass" if one_pass else "two_pass", self.max_memory,
                                       one_pass_bound(kept_bytes(rec.calls)),
                                       _sum_bytes(kept_bytes(kept), streaming.kept_bytes()))
        calls: dict[int, list] = {}
        for call, delta in zip(kept, gradients[len(streamed):]):
            calls.setdefault(id(call.layer), []).append((call, accumulation_delta(call.probe, delta)))
        squared, direct_grads, table = self._squared_norms(calls, losses)
        squared = _total([p for p in [squared, *gradients[: len(streamed)]] if p is not None])
        if squared is None:
            squared = tf.zeros([tf.shape(losses)[0]], tf.float32)
        factors, keep = clipping.clip_factors(squared, clip_norm, valid)
        sums = self._raw_weighted_sums(calls, factors, keep, direct_grads)
        if one_pass:
            self._add(sums, self._tapped_sums(streamed, streaming, factors, keep))
        elif streamed:
            streaming.mode, streaming.keep, streaming.factors = SUMS, self.units.repeat(keep), self.units.repeat(factors)
            sinks = [(k, sink) for call in streamed
                     for k, sink in zip(self._indices_of(call.layer), call.tap.sum_sinks)]
            streamed_sums = tape.gradient(row_losses, [sink for _, sink in sinks],
                                          output_gradients=self._kept_loss_weights(keep, row_losses.dtype))
            streaming.mode = None
            self._add(sums, list(zip([k for k, _ in sinks], streamed_sums)))
        self._remember(table + streaming.methods)
        sums = [_as_statistic(total_k, s) for total_k, s in zip(sums, self.selections)]
        return ClippedBatch(sums, squared, losses, predictions, keep)

    def _kept_loss_weights(self, keep, dtype) -> tf.Tensor:
        """The sum pass's weight of each row's loss: the norm pass's (``1``, ``1/K`` for a view) for
        the rows of kept examples, so that their taps receive the same ``delta``; 0 for the others."""
        weights = tf.cast(view_rows(keep, self.views), dtype)
        return weights / tf.cast(self.views, dtype) if self.views > 1 else weights

    def _time_distributed(self, layer) -> bool:
        """A layer inside ``TimeDistributed``: several rows per view, whose gradients are materialised."""
        return id(layer) in self._grouped

    def _tapped_sums(self, streamed, streaming: Streaming, factors, keep) -> list:
        """``[(selection index, S^l)]`` of the calls tapped in a one-pass step, from what each tap
        kept: ``sum_i c_i g_i`` of its per-example (per-unit) gradients, or its rule's sums of
        ``c * delta`` (each view row scaled by its example's factor)."""
        pairs = []
        for call in streamed:
            indices = self._indices_of(call.layer)
            kept = streaming.kept_for_sums[id(call)]
            if kept.grads is not None:
                pairs.extend((indices[position], _clipped_sum_of(grads, factors, keep))
                             for position, grads in kept.grads.items())
                continue
            rule, selections = streaming.rules[id(call.layer)]
            row_factors, row_keep = self.units.repeat(factors), self.units.repeat(keep)
            layer_totals = layer_sums(rule, call, _clipped_delta(kept.delta, row_factors, row_keep), row_keep,
                                      selections, streaming.materialised[id(call)])
            pairs.extend(zip(indices, layer_totals))
        return pairs

    @staticmethod
    def _add(sums: list, pairs) -> None:
        for k, total_k in pairs:
            sums[k] = total_k if sums[k] is None else sums[k] + total_k

    def _fits_in_one_pass(self, x) -> bool:
        """True when the model's layer output shapes, known before the step, put the most one pass
        keeps (:func:`~sparta_tf.per_example.memory_budget.one_pass_bound`) within ``max_memory``;
        otherwise the recorded calls decide (:meth:`_streamed_calls`). One pass keeps its forward
        tensors only until its single backward pass has used them (a non-persistent tape)."""
        batch = tf.nest.flatten(x)[0].shape[0]
        if self.max_memory == 0 or batch is None or any(is_recurrent(layer) for layer in self.layers):
            return False  # a recurrent layer's probes are its steps', which its output shape does not show
        predicted = one_pass_bound(output_gradient_bytes(self.model, batch))
        return predicted is not None and predicted <= self.max_memory

    def _indices_of(self, layer) -> list[int]:
        return next(indices for planned, _, indices in self.plan if planned is layer)

    def _streamed_calls(self, calls, one_pass: bool) -> tuple[list, list, bool]:
        """``(streamed, kept, one_pass)``: the calls whose norms their taps compute (every call with a
        tap of a layer called once: the norm of a layer called twice needs both calls' gradients),
        the others, whose output gradients the step keeps, and whether the step runs in one pass.

        ``one_pass``: the model's output shapes already put one pass within ``max_memory``
        (:meth:`_fits_in_one_pass`); else the recorded calls decide: two passes when what one pass
        keeps exceeds ``max_memory`` (or ``max_memory`` is 0). Two passes tap no call of a step with
        a low-precision layer output (bfloat16, float16): the second backward pass could round the
        recomputed output gradients otherwise than the first (XLA fuses the two passes
        differently), and a contribution clipped by the first pass's norm could then exceed ``C``
        by that rounding. One pass has a single backward pass, so it taps them too."""
        counts = Counter(id(call.layer) for call in calls)
        streamed = [call for call in calls if call.tap is not None and counts[id(call.layer)] == 1
                    and not self._time_distributed(call.layer)]
        if not one_pass:
            low_precision = any(is_low_precision(call.probe) for call in calls)
            one_pass_bytes = one_pass_bound(kept_bytes(calls))
            too_big = self.max_memory == 0 or (one_pass_bytes is not None and one_pass_bytes > self.max_memory)
            one_pass = not too_big or not streamed or low_precision
        return streamed, _untapped(calls, streamed), one_pass

    def selection_statistic(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor, clip_norm: float | None,
                            groups=None) -> ClippedBatch:
        """A selection step's noise-free statistic without a model's worth of per-example gradients.

        ``clip_norm=None``: no clipping (``c_i = 1`` for kept examples; the non-private oracle).
        ``groups=None``: the linear statistic ``sum_i c_i g_i`` (``abs_sum``, ``signed``; a DP
        step's clipped sum); otherwise ``[n_rows]`` per group: ``sum_i sum_{k in row j} |c_i g_i[k]|``
        (``sum_abs``), by the exact factorisation for Dense on 2-D input, else from one layer's
        per-example gradients at a time.
        """
        return self._statistic(self.record(x, y, loss_fn, valid), clip_norm, groups)

    def coverage_sums(self, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor):
        """``(sum_i g_i unclipped, the batch gradient of the same pass)`` per selection (compact;
        the batch gradient None where the loss does not depend on the variable), for
        :func:`sparta_tf.per_example.coverage.check_coverage`."""
        recorded = self.record(x, y, loss_fn, valid, watch=[s.variable for s in self.selections])
        return self._statistic(recorded, None, None).sums, recorded.batch_gradients

    def _statistic(self, recorded: RecordedPass, clip_norm, groups) -> ClippedBatch:
        calls, losses, predictions, valid = recorded.calls, recorded.losses, recorded.predictions, recorded.valid
        squared, direct_grads, table = self._squared_norms(calls, losses)
        self._remember(table)
        if squared is None:
            squared = tf.zeros([tf.shape(losses)[0]], tf.float32)
        if clip_norm is None:
            keep = tf.logical_and(valid, tf.math.is_finite(squared))
            factors = tf.cast(keep, squared.dtype)
        else:
            factors, keep = clipping.clip_factors(squared, clip_norm, valid)
        if groups is None:
            sums = self._weighted_sums(calls, factors, keep, direct_grads)
        else:
            sums = self._abs_row_sums(calls, factors, keep, direct_grads, groups)
        return ClippedBatch(sums, squared, losses, predictions, keep)

    def _abs_row_sums(self, calls, factors, keep, direct_grads: dict, groups) -> list:
        if self.units.rows > 1:  # |c_i g_i| needs each example's gradient: its views' gradients summed
            direct_grads = {**direct_grads, **self._unit_gradients(calls, direct_grads)}
        sums: list = [None] * len(self.selections)
        for layer, rule, indices in self.plan:
            for k in indices:
                group = groups[k]
                if k in direct_grads:  # shared layer: |sum over calls| needs the per-example sum
                    g = keep_examples(direct_grads[k], keep) * tf.reshape(factors, [-1] + [1] * (direct_grads[k].shape.rank - 1))
                    sums[k] = tf.reduce_sum(group.to_row_view(tf.abs(g), batch_dims=1), axis=[0, 1])
                    continue
                for call, delta in calls.get(id(layer), []):
                    if delta is not None:
                        sums[k] = rule.abs_row_sums(layer, call, _clipped_delta(delta, factors, keep), keep,
                                                    self.selections[k], group)
        return [tf.zeros([g.n_rows]) if s is None else s for s, g in zip(sums, groups)]

    def _unit_gradients(self, calls, known: dict) -> dict:
        """``{selection index: [B, *compact]}``: the per-example gradients (each example's view rows'
        gradients summed) of the selections not in ``known``, from their rules' reference."""
        grads: dict = {}
        for layer, rule, indices in self.plan:
            wanted = [k for k in indices if k not in known]
            for call, delta in calls.get(id(layer), []) if wanted else []:
                if delta is None:
                    continue
                rows = rule.reference.per_example_grads(layer, call, delta, [self.selections[k] for k in wanted])
                for k, g in zip(wanted, rows):
                    grads[k] = self.units.sum(g) if k not in grads else grads[k] + self.units.sum(g)
        return grads

    # ------------------------------------------------------------------ norms

    def _squared_norms(self, calls, losses):
        """``([B] or None, {selection index: materialised per-example grads}, cost table)``.

        Layers are taken from the output back, each after the previous one's norms (a control
        dependency): TensorFlow would otherwise run many layers' norms at once, with all their
        temporaries alive (ResNet-20-GN at ``B = 128``: 1.34 GiB above the recording pass's working
        set at once, 0.65 GiB one layer at a time), and each output gradient can be freed as soon as
        its layer's norms (and materialised gradients) are done."""
        parts, direct_grads, table = [], {}, []
        batch = tf.shape(losses)[0]
        for layer, rule, indices in reversed(self.plan):
            recorded = [(call, delta) for call, delta in calls.get(id(layer), []) if delta is not None]
            if not recorded:
                continue
            selections = [self.selections[k] for k in indices]
            if len(recorded) == 1 and not self._time_distributed(layer):
                call, delta = recorded[0]
                materialised: dict = {}
                with tf.control_dependencies(parts[-1:]):  # one layer's temporaries at a time
                    norms, methods = rule.unit_squared_norms(layer, call, delta, selections, self.units, materialised)
                check_rows(layer, norms, losses)
                direct_grads.update({indices[position]: g for position, g in materialised.items()})
                parts.append(norms)
                table.extend(methods)
                continue
            # Shared layer (the per-example gradient sums over calls) or inside TimeDistributed (sums
            # over rows): the layer's per-example gradients, materialised.
            for call, delta in recorded:
                for k, g in zip(indices, rule.reference.per_example_grads(layer, call, delta, selections)):
                    g = per_example_sum(g, batch) if self.is_grouped(layer) else g
                    direct_grads[k] = g if k not in direct_grads else direct_grads[k] + g
            parts.extend(squared_sum(direct_grads[k]) for k in indices)
            method = ("direct_views" if self.views > 1 else
                      "direct_time_distributed" if self.is_grouped(layer) else "direct_shared_layer")
            table.extend(NormMethod(layer.name, variable_key(s.variable), method, None, None) for s in selections)
        return _total(parts), direct_grads, table

    # ------------------------------------------------------------------- sums

    def _weighted_sums(self, calls, factors: tf.Tensor, keep: tf.Tensor, direct_grads: dict) -> list:
        return [_as_statistic(total, s) for total, s in
                zip(self._raw_weighted_sums(calls, factors, keep, direct_grads), self.selections)]

    def _raw_weighted_sums(self, calls, factors: tf.Tensor, keep: tf.Tensor, direct_grads: dict) -> list:
        """``sum_i c_i g_i`` per selection from the kept output gradients (None for a selection none reaches)."""
        sums: list = [None] * len(self.selections)
        for layer, rule, indices in self.plan:
            for k in indices:  # per-example gradients a norm rule computed anyway: sum them
                if k in direct_grads:
                    sums[k] = _clipped_sum_of(direct_grads[k], factors, keep)
            rest = [k for k in indices if k not in direct_grads]
            if not rest:
                continue
            for call, delta in calls.get(id(layer), []):
                if delta is None:
                    continue
                row_keep = self.units.repeat(keep)  # one row per view: each scaled by its example's factor
                delta_c = _clipped_delta(delta, self.units.repeat(factors), row_keep)
                layer_sums = rule.weighted_sums(layer, call, delta_c, row_keep, [self.selections[k] for k in rest])
                for k, s in zip(rest, layer_sums):
                    sums[k] = s if sums[k] is None else sums[k] + s
        return sums

    def _remember(self, table: list[NormMethod]) -> None:
        self._cost_table = table
        if table and not self._logged:
            self._logged = True
            counts: dict[str, int] = {}
            for row in table:
                counts[row.method] = counts.get(row.method, 0) + 1
            logger.info("book-keeping engine: per-example norms by %s",
                        ", ".join(f"{method} x{count}" for method, count in sorted(counts.items())))


def _clipped_delta(delta: tf.Tensor, factors: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
    """``c_i delta_i`` for the examples kept, exactly zero for the others (``0 * nan`` cannot reach them)."""
    scale = tf.reshape(tf.cast(factors, delta.dtype), [-1] + [1] * (delta.shape.rank - 1))
    return keep_examples(delta * scale, keep)


def _clipped_sum_of(grads: tf.Tensor, factors: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
    """``sum_i c_i g_i`` of materialised per-example gradients ``[B, ...]`` over the examples kept."""
    grads = to_accumulation(keep_examples(grads, keep))
    return tf.tensordot(tf.cast(factors, grads.dtype), grads, axes=1)


def _sum_bytes(*sizes) -> int | None:
    return None if None in sizes else sum(sizes)


def _untapped(calls, tapped) -> list:
    tapped_ids = {id(c) for c in tapped}
    return [c for c in calls if id(c) not in tapped_ids]


def _total(parts: list) -> tf.Tensor | None:
    """``sum_l ||g_i^l||^2`` over layers, in float64 if any layer's part is (a float64 layer)."""
    if not parts:
        return None
    dtype = tf.float64 if any(p.dtype == tf.float64 for p in parts) else tf.float32
    return tf.add_n([tf.cast(p, dtype) for p in parts])


def _as_statistic(total, selection: VariableSelection) -> tf.Tensor:
    """A selection's clipped sum in its compact shape (static, whatever the batch's shapes) and
    the accumulation dtype: the noise is added to it there, before any cast to a low-precision
    variable dtype (a cast after the release is post-processing)."""
    dtype = accumulation_dtype(selection.variable.dtype)
    if total is None:
        return tf.zeros(selection.compact_shape, dtype)
    return tf.reshape(tf.cast(total, dtype), selection.compact_shape)


def make_bookkeeping_engine(model: tf.keras.Model, selections: Sequence[VariableSelection], views: int = 1,
                            max_memory: int | None = None):
    """``(BookkeepingEngine, None)``, or ``(None, reason)`` when a selected variable is not owned
    by a leaf layer (then no per-layer rule can see its inputs and output gradients) or is owned
    by several (tied weights: see :func:`_shared_selections`)."""
    plan, reason = LayerwiseEngine.plan_for(model, selections, ghost_rule_for)
    if plan is None:
        return None, reason
    shared = _shared_selections(plan)
    if shared:
        return None, (f"variable {variable_key(selections[shared[0]].variable)!r} is owned by more than one layer "
                      "(tied weights): its per-example norm needs every layer's part summed first, which "
                      "per-layer norms cannot give")
    return BookkeepingEngine(model, selections, plan, views, max_memory), None


def _shared_selections(plan) -> list[int]:
    """Indices of selections that more than one layer of ``plan`` owns. Their per-example gradient
    is the *sum* of the layers' parts, and ``||g_A + g_B||^2`` is not ``||g_A||^2 + ||g_B||^2``:
    adding per-layer norms would clip such an example at up to ``sqrt(L) C`` for ``L`` owners."""
    owners = Counter(k for _, _, indices in plan for k in indices)
    return sorted(k for k, count in owners.items() if count > 1)


def clipped_batch(engine, x, y, loss_fn: PerExampleLoss, valid: tf.Tensor, clip_norm: float) -> ClippedBatch:
    """``sum_i c_i g_i`` of a (micro-)batch with any engine: book-keeping, or materialised
    per-example gradients clipped by :func:`sparta_tf.dp_step.clipping.clipped_sum`."""
    if isinstance(engine, BookkeepingEngine):
        return engine.clipped_sum(x, y, loss_fn, valid, clip_norm)
    result = engine(x, y, loss_fn, valid)
    sums, norms = clipping.clipped_sum(result.grads, clip_norm, result.valid)
    sums = [_as_statistic(total, s) for total, s in zip(sums, engine.selections)]
    kept = tf.logical_and(result.valid, tf.math.is_finite(norms))  # clipped_sum's keep
    return ClippedBatch(sums, tf.square(norms), result.losses, result.predictions, kept)
