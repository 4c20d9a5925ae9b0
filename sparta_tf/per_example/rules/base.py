"""The two rule interfaces of a layer, and the generic rule that is exact for any layer.

For a layer ``z = f(a; W)`` applied to a batch, back-propagating the *sum* of per-example losses
``sum_i L_i`` gives, for every example, the output gradient ``delta_i = dL_i / dz_i`` at the
rule's probe point (no layer mixes examples: BatchNorm in training mode is refused, see
:mod:`sparta_tf.model_checks`). A rule turns the layer's recorded inputs ``a_i`` and ``delta_i``
into what the DP step needs of the layer's own variables ``W``:

* :class:`LayerRule` (materialising): the per-example gradients ``g_i = dL_i/dW``, ``[B, *compact]``
  in the compact form of each selection (:mod:`sparta_tf.trainable`): ``[B, *W.shape]`` for a
  whole variable, ``[B, fan_in, k]`` for ``k`` selected rows, ``[B, k]`` for ``k`` entries;
* :class:`GhostRule` (book-keeping): the squared norms ``||g_i||^2`` and the clipped sum
  ``S = sum_i c_i g_i`` given ``c * delta``, without ``[B, *W.shape]`` where the layer's algebra
  allows (:mod:`sparta_tf.per_example.bookkeeping`). A ghost rule carries its materialising
  ``reference`` (the same probe point); the base class materialises ``g_i`` from it.

:class:`VjpRule` is the generic materialising rule: the per-example vector-Jacobian product
``dL_i/dW = delta_i^T J_W f(a_i; W)``, a batch-of-one re-run of the layer's own ``call`` per
example, vectorised with ``tf.vectorized_map``. It is exact for any layer whose call is a
deterministic function of its arguments; a layer no registered rule matches gets it
(:mod:`sparta_tf.per_example.registry`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import tensorflow as tf

from sparta_tf.backend import tf_variable, variable_key
from sparta_tf.example_rows import keep_examples
from sparta_tf.per_example.arguments import split_arguments
from sparta_tf.per_example.units import ONE_ROW, Units
from sparta_tf.precision import to_accumulation

if TYPE_CHECKING:  # pragma: no cover
    from sparta_tf.trainable import VariableSelection

Tensor = tf.Tensor


class LayerRule:
    """How to get per-example gradients of one layer's own variables (materialising).

    A rule for a new layer overrides :meth:`variable_grad` (one variable at a time, from
    ``call.inputs``, the layer's recorded first argument, and ``delta = [dL_1/dz_1, ...]``, both
    ``[B, ...]``) or :meth:`per_example_grads` (all the layer's selected variables at once).

    ``probe_point`` says where the recording forward pass adds its zero probe
    (whose gradient is ``delta``): ``"output"`` (after the whole layer, the default),
    ``"pre_activation"`` (the output before the layer's fused ``activation=``:
    the call runs with a linear activation and the activation is applied to the
    probed output) or ``"convolution"`` (after the convolution, before bias and
    activation); a rule that records otherwise overrides :meth:`record`.
    ``norm_method`` names the rule in the engine's cost table. ``compacts_rows``: ``variable_grad``
    returns a rows selection already in its compact ``[B, fan_in, k]`` form (else the full
    ``[B, *W.shape]``, which :meth:`per_example_grads` compacts).
    """

    probe_point = "output"
    norm_method = "per_layer_vjp"
    compacts_rows = False  # variable_grad returns rows selections already compact (else: full shape)

    def record(self, recording, layer, original_call: Callable, args: tuple, kwargs: dict):
        """The hooked call inside a recording pass: the layer's output with zero probes added.

        A re-run of an output-probed layer goes through ``layer.__call__`` (outside recording
        passes the hook is inert), so that Keras casts its variables to the compute dtype as in
        the recorded pass (mixed precision)."""
        if self.probe_point == "pre_activation":
            with linear_activation(layer) as activation:
                output = original_call(*args, **kwargs)
            return activation(recording.probe(layer, args, kwargs, output, pre_activation_call(layer)))
        output = original_call(*args, **kwargs)
        rerun = layer.__call__ if self.probe_point == "output" else original_call
        return recording.probe(layer, args, kwargs, output, rerun)

    def per_example_grads(
        self,
        layer: tf.keras.layers.Layer,
        call: "RecordedCall",
        delta: Tensor,
        selections: Sequence["VariableSelection"],
    ) -> list[Tensor]:
        """Per-example gradients ``[B, *compact_shape]`` of each selection."""
        return [compact_grads(self.variable_grad(layer, call, delta, sel), sel, self.compacts_rows) for sel in selections]

    def variable_grad(self, layer, call: "RecordedCall", delta: Tensor, selection) -> Tensor:
        """Per-example gradients of one variable (rows already compact, else full shape)."""
        raise NotImplementedError

    @staticmethod
    def bias_grad(layer, delta: Tensor, selection) -> Tensor:
        """``dL_i/db = sum_t delta_it`` for a bias added after the probe point."""
        if selection.variable is getattr(layer, "bias", None) or selection.variable is getattr(layer, "beta", None):
            return sum_over_middle_axes(delta)
        raise ValueError(f"{type(layer).__name__} rule cannot handle variable {variable_key(selection.variable)}")


@contextlib.contextmanager
def linear_activation(layer):
    """Within the block ``layer`` (Dense, EinsumDense, a Conv) runs without its fused activation;
    yields the activation, which the caller applies to the (probed) pre-activation output."""
    activation = getattr(layer, "activation", None) or tf.keras.activations.linear
    object.__setattr__(layer, "activation", tf.keras.activations.linear)
    try:
        yield activation
    finally:
        object.__setattr__(layer, "activation", activation)


def pre_activation_call(layer) -> Callable:
    """``layer.__call__`` without the fused activation (for per-example re-runs)."""
    def call(*args, **kwargs):
        with linear_activation(layer):
            return layer(*args, **kwargs)
    return call


class RecordedCall:
    """One call of a hooked layer during the recording forward pass.

    ``probe``: the zero tensor added to the output (its gradient is ``delta``); for a layer that
    returns a structure, a list of probes, one per floating-point tensor at ``output_positions``
    of the flattened output. A recurrent layer's call records the step inputs and the probes of
    every step (:mod:`sparta_tf.per_example.rules.recurrent`).
    """

    def __init__(self, layer, args, kwargs, probe, original_call: Callable, output_positions=None):
        self.layer = layer
        self.args = args
        self.kwargs = kwargs
        self.probe = probe
        self.original_call = original_call
        self.output_positions = output_positions
        self.tap = None  # the sinks of a two-pass step's tap (sparta_tf.per_example.streaming)

    @property
    def inputs(self) -> Tensor:
        return self.args[0]

    def probed_outputs(self, output):
        """The tensors of a re-run's ``output`` that correspond to the probes (same structure)."""
        if self.output_positions is None:
            return output
        leaves = tf.nest.flatten(output)
        return [leaves[k] for k in self.output_positions]


def sum_over_middle_axes(t: Tensor) -> Tensor:
    """[B, ..., C] -> [B, C]: sums every axis except the first and the last."""
    rank = t.shape.rank
    if rank == 2:
        return t
    return tf.reduce_sum(t, axis=list(range(1, rank - 1)))


def selected_rows(delta: Tensor, selection) -> Tensor:
    """The output channels of ``delta`` that a rows selection trains (all otherwise)."""
    if selection.kind == "rows":
        return tf.gather(delta, selection.rows, axis=-1)
    return delta


def compact_grads(grads: Tensor, selection, rows_compact: bool) -> Tensor:
    """Per-example gradients in the selection's compact form (``rows_compact``: rows already are)."""
    if selection.kind == "entries" or (selection.kind == "rows" and not rows_compact):
        return selection.compact(grads, batch_dims=1)
    return grads


class VjpRule(LayerRule):
    """Any layer: per-example VJP of the layer's own call, vectorised over examples.

    ``dL_i/dW = delta_i^T J_W f(a_i; W)`` computed as ``tf.vectorized_map`` of a
    batch-of-one re-run of the layer's original ``call`` with
    ``output_gradients = delta_i``. The re-run of example ``i`` sees only row ``i``
    of every argument with a batch dimension (positional and keyword: ``mask=``,
    attention masks; :mod:`sparta_tf.per_example.arguments`).

    ``delta`` arrives in the accumulation dtype (float32 for a bfloat16 / float16 layer); the
    re-run takes it back in the layer's output dtype (exact: it was that dtype), and its
    gradients are returned in the accumulation dtype. ``probe_point="pre_activation"`` re-runs the
    layer without its fused activation (EinsumDense whose equation is not Dense-like).
    """

    def __init__(self, probe_point: str = "output"):
        self.probe_point = probe_point

    def per_example_grads(self, layer, call, delta, selections):
        variables = [tf_variable(sel.variable) for sel in selections]
        first = tf.nest.flatten(delta)[0]
        split = split_arguments(layer.name, call.args, call.kwargs, first.shape[0], tf.shape(first)[0])
        output_delta = delta if call.probe is None else tf.nest.map_structure(
            lambda d, p: tf.cast(d, p.dtype), delta, call.probe)

        def one_example(elems):
            example_arguments, example_delta = elems
            args, kwargs = split.rebuild([t[None] for t in example_arguments])
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(variables)
                out = call.probed_outputs(call.original_call(*args, **kwargs))
            grads = tape.gradient(
                out, variables, output_gradients=tf.nest.map_structure(lambda d: d[None], example_delta),
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            return [to_accumulation(tf.convert_to_tensor(g)) for g in grads]

        with tf.control_dependencies(split.checks):
            full = tf.vectorized_map(one_example, (split.batched, output_delta))
        return [sel.compact(g, batch_dims=1) for sel, g in zip(selections, full)]


VJP_RULE = VjpRule()
PRE_ACTIVATION_VJP_RULE = VjpRule("pre_activation")


class NormMethod(NamedTuple):
    """How one selection's per-example norms are computed, with the cost model's numbers
    (multiply-adds per example; ``None`` where a method does not apply)."""

    layer: str
    variable: str
    method: str  # rank_one / ghost / direct / elementwise / per_layer_vjp
    ghost_cost: int | None
    direct_cost: int | None
    # what the step keeps of the layer until the clip factors are known: "kept" (its output
    # gradient), "per_example" (its per-example gradients, where smaller) or "streamed" (nothing;
    # two passes)
    output_gradient: str = "kept"


def squared_sum(t: Tensor) -> Tensor:
    """``[B]``: sum of squares of ``[B, ...]``, in the accumulation dtype (float32 for low precision)."""
    t = to_accumulation(t)
    return tf.reduce_sum(tf.reshape(tf.square(t), [tf.shape(t)[0], -1]), axis=1)


def keep_materialised(materialised: dict | None, grads) -> None:
    """Records ``(position, per-example gradients)`` pairs a rule computed anyway."""
    if materialised is not None:
        materialised.update(grads)


class GhostRule:
    """Per-example squared norms and clipped sums of one layer's selected variables (book-keeping).

    ``squared_norms(layer, call, delta, selections) -> ([B], [NormMethod])`` and
    ``weighted_sums(layer, call, delta_c, keep, selections) -> [compact sums]``
    where ``delta_c = c * delta`` (already zero for examples that are not kept).
    ``reference`` is the materialising rule of the same layer (the same probe point): the base
    class computes ``||g_i||^2`` from its per-example gradients, which the engine then sums with
    the clip factors; a rule whose algebra factorises overrides both methods.
    ``unit_squared_norms`` takes units of several consecutive rows clipped as one (an example's
    views, :mod:`~sparta_tf.per_example.units`): by default their rows' per-example gradients summed;
    the rules of linear maps override it. ``weighted_sums`` stays per row (``delta_c`` then carries
    each row's unit factor).
    """

    reference: LayerRule = VJP_RULE
    sums_any_selection = False
    """True for a rule whose ``weighted_sums`` takes any of its layer's selections; else it takes
    those whose norms ``squared_norms`` factorised (did not materialise), the others' sums being the
    base class's (the two-pass step, :mod:`~sparta_tf.per_example.streaming`, asks for every one)."""

    def __init__(self, reference: LayerRule | None = None):
        if reference is not None:
            self.reference = reference

    @property
    def probe_point(self) -> str:
        return self.reference.probe_point

    def record(self, recording, layer, original_call, args, kwargs):
        """What the hooked call does in a recording pass: the reference rule's recording."""
        return self.reference.record(recording, layer, original_call, args, kwargs)

    def squared_norms(self, layer, call, delta, selections, materialised: dict | None = None):
        """``([B], [NormMethod])``; per-example gradients a rule computed anyway go into
        ``materialised[position]`` (compact form), so the engine sums them instead of recomputing."""
        return self.materialised_norms(layer, call, delta, selections, ONE_ROW, materialised)

    def unit_squared_norms(self, layer, call, delta, selections, units: Units = ONE_ROW,
                           materialised: dict | None = None):
        """``([U], [NormMethod])``: ``||g_u||^2`` of the units of ``units.rows`` consecutive rows
        (:mod:`~sparta_tf.per_example.units`), ``g_u = sum_{r in u} g_r``; ``materialised`` as for
        :meth:`squared_norms`, per unit. One row per unit: :meth:`squared_norms`. Otherwise
        :meth:`materialised_norms` (exact for any layer); the rules of linear maps override this
        with the ghost or direct norm over a unit's merged positions."""
        if units.rows == 1:
            return self.squared_norms(layer, call, delta, selections, materialised)
        return self.materialised_norms(layer, call, delta, selections, units, materialised)

    def materialised_norms(self, layer, call, delta, selections, units: Units = ONE_ROW,
                           materialised: dict | None = None):
        """``||g_u||^2`` from the reference's per-row gradients summed per unit (kept in ``materialised``)."""
        grads = [units.sum(g) for g in self.reference.per_example_grads(layer, call, delta, selections)]
        keep_materialised(materialised, enumerate(grads))
        method = units.method(self.reference.norm_method)
        methods = [NormMethod(layer.name, variable_key(s.variable), method, None, None) for s in selections]
        return tf.add_n([squared_sum(g) for g in grads]), methods

    def abs_row_sums(self, layer, call, delta_c, keep, selection, group) -> Tensor:
        """``[n_rows]``: ``sum_i sum_{k in row j} |c_i g_i[k]|`` (``c_i >= 0`` is in ``delta_c``), from
        this layer's own per-example gradients (one layer at a time)."""
        grads = self.reference.per_example_grads(layer, call, delta_c, [selection])[0]
        grads = keep_examples(grads, keep)
        return tf.reduce_sum(group.to_row_view(tf.abs(grads), batch_dims=1), axis=[0, 1])

    def weighted_sums(self, layer, call, delta_c, keep, selections) -> list[Tensor]:
        """``S = sum_i c_i g_i`` from ``delta_c = c * delta``: the reference's per-example gradients of
        ``delta_c`` (``g_i`` is linear in ``delta_i``), those of examples not kept set to zero, summed.
        The one-pass engine sums the gradients ``squared_norms`` materialised instead; the two-pass
        step (:mod:`~sparta_tf.per_example.streaming`), which keeps nothing, calls this. Rules whose
        algebra factorises override it with one batched op."""
        grads = self.reference.per_example_grads(layer, call, delta_c, selections)
        return [tf.reduce_sum(to_accumulation(keep_examples(g, keep)), axis=0) for g in grads]
