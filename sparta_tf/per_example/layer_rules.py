"""Per-example weight-gradient rules, one per layer type.

For a layer ``z = f(a; W)`` applied to a batch, back-propagating the *sum* of
per-example losses ``sum_i L_i`` gives, for every example, the output gradient
``delta_i = dL_i / dz_i`` (no layer mixes examples: BatchNorm in training mode
is rejected, see :mod:`sparta_tf.model_checks`). The per-example gradient of a
weight then follows from the layer's own input ``a_i`` and ``delta_i``:

* Dense, ``z = a W + b`` with ``a: [B, ..., in]``::

      dL_i/dW = sum_t a_{i,t}^T delta_{i,t}       ([in, out])
      dL_i/db = sum_t delta_{i,t}                  ([out])

* Conv2D, ``z = conv(a, K) + b`` (channels last, ``groups = 1``): with
  ``P(a_i)`` the im2col patches ``[H'W', kh*kw*c_in]``::

      dL_i/dK = reshape(P(a_i)^T delta_i, [kh, kw, c_in, c_out])
      dL_i/db = sum_{h,w} delta_{i,h,w}

  One batched matmul, instead of the per-example ``Conv2DBackpropFilter``
  that ``tf.vectorized_map`` has no vectorised rule for (it falls back to a
  ``while_loop`` over the examples).

* Any other layer owning variables: the per-example vector-Jacobian product
  ``delta_i^T d f(a_i; W) / dW``, vectorised over examples with
  ``tf.vectorized_map`` (cheap for normalisation layers, whose forward pass is
  elementwise).

Every rule returns materialised per-example gradients in the *compact* form
of the selection it is asked about (:mod:`sparta_tf.trainable`): ``[B,
*W.shape]`` for a whole variable, ``[B, fan_in, k]`` for ``k`` selected rows,
``[B, k]`` for ``k`` selected entries. For rows of Dense and Conv2D kernels
only the selected output channels of ``delta`` enter the matmul,
``dW_i[:, rows] = P(a_i)^T delta_i[..., rows]``, so the cost scales with the
number of trainable rows (the TF counterpart of the paper's Section 7, which
stacks the trainable rows as their own matrix). Entry selections and other
layers compute the whole per-example gradient and gather.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Sequence

import tensorflow as tf

from sparta_tf.backend import tf_variable, variable_key
from sparta_tf.per_example.arguments import split_arguments
from sparta_tf.per_example.patches import (
    _output_size_and_padding,
    extract_patches,
    pad_like_convolution,
    static_or_dynamic,
)
from sparta_tf.precision import to_accumulation

if TYPE_CHECKING:  # pragma: no cover
    from sparta_tf.trainable import VariableSelection

Tensor = tf.Tensor


class LayerRule:
    """How to get per-example gradients of one layer's own variables.

    ``probe_point`` says where the recording forward pass adds its zero probe
    (whose gradient is ``delta``): ``"output"`` (after the whole layer),
    ``"pre_activation"`` (the output before the layer's fused ``activation=``:
    the call runs with a linear activation and the activation is applied to the
    probed output) or ``"convolution"`` (after the convolution, before bias and
    activation). ``norm_method`` names the rule in the engine's cost table.
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
            return activation(recording.probe(layer, args, kwargs, output, _pre_activation_call(layer)))
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
        return [_finish(self.variable_grad(layer, call, delta, sel), sel, self.compacts_rows) for sel in selections]

    def variable_grad(self, layer, call: "RecordedCall", delta: Tensor, selection) -> Tensor:
        """Per-example gradients of one variable (rows already compact, else full shape)."""
        raise NotImplementedError

    @staticmethod
    def _bias_grad(layer, delta: Tensor, selection) -> Tensor:
        """``dL_i/db = sum_t delta_it`` for a bias added after the probe point."""
        if selection.variable is getattr(layer, "bias", None) or selection.variable is getattr(layer, "beta", None):
            return _sum_over_middle_axes(delta)
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


def _pre_activation_call(layer) -> Callable:
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
    every step (:mod:`sparta_tf.per_example.recurrent`).
    """

    def __init__(self, layer, args, kwargs, probe, original_call: Callable, output_positions=None):
        self.layer = layer
        self.args = args
        self.kwargs = kwargs
        self.probe = probe
        self.original_call = original_call
        self.output_positions = output_positions

    @property
    def inputs(self) -> Tensor:
        return self.args[0]

    def probed_outputs(self, output):
        """The tensors of a re-run's ``output`` that correspond to the probes (same structure)."""
        if self.output_positions is None:
            return output
        leaves = tf.nest.flatten(output)
        return [leaves[k] for k in self.output_positions]


def _sum_over_middle_axes(t: Tensor) -> Tensor:
    """[B, ..., C] -> [B, C]: sums every axis except the first and the last."""
    rank = t.shape.rank
    if rank == 2:
        return t
    return tf.reduce_sum(t, axis=list(range(1, rank - 1)))


class DenseRule(LayerRule):
    """Dense, probed before its activation: ``dW_i = sum_t a_it^T delta_it``, ``db_i = sum_t delta_it``."""

    probe_point = "pre_activation"
    norm_method = "direct"
    compacts_rows = True

    def variable_grad(self, layer, call, delta, selection):
        if selection.variable is not layer.kernel:
            return self._bias_grad(layer, delta, selection)
        a = tf.cast(call.inputs, delta.dtype)
        d = _selected_rows(delta, selection)
        if a.shape.rank == 2:
            return a[:, :, None] * d[:, None, :]
        batch = tf.shape(a)[0]
        a3 = tf.reshape(a, [batch, -1, a.shape[-1]])
        d3 = tf.reshape(d, [batch, -1, d.shape[-1]])
        return tf.matmul(a3, d3, transpose_a=True)


class Conv2DRule(LayerRule):
    """Conv2D (channels last, ``groups = 1``) via im2col patches and one batched matmul."""

    probe_point = "convolution"
    norm_method = "direct"
    compacts_rows = True

    def variable_grad(self, layer, call, delta, selection):
        if selection.variable is not layer.kernel:
            return self._bias_grad(layer, delta, selection)
        grads = self._kernel_grads(layer, call.inputs, _selected_rows(delta, selection))
        if selection.kind == "rows":
            return grads
        return tf.reshape(grads, tf.concat([tf.shape(grads)[:1], selection.shape], axis=0))

    @staticmethod
    def _kernel_grads(layer, inputs: Tensor, delta: Tensor) -> Tensor:
        """``[B, kh*kw*c_in, c]`` for the ``c`` output channels present in ``delta``."""
        if _use_depthwise(layer, delta.shape[-1]):
            return _kernel_grads_depthwise(layer, inputs, delta)
        if _use_shifted_views(layer, delta):
            return _kernel_grads_shifted(layer, inputs, delta)
        patches = extract_patches(
            tf.cast(inputs, delta.dtype),
            kernel_size=tuple(layer.kernel_size),
            strides=tuple(layer.strides),
            dilations=tuple(layer.dilation_rate),
            padding=layer.padding.upper(),
        )
        batch = tf.shape(patches)[0]
        patches = tf.reshape(patches, [batch, -1, patches.shape[-1]])
        delta = tf.reshape(delta, [batch, -1, delta.shape[-1]])
        return tf.matmul(patches, delta, transpose_a=True)


SHIFTED_MIN_POSITIONS = 64
"""From this many output positions on, per-example kernel gradients are summed
over the ``kh*kw`` shifted views of the input (one batched matmul each) instead
of one matmul over concatenated im2col patches: the same products without the
concatenated copy (measured 1.2-2.3x faster on 2 CPU cores for ResNet-18
layers with >= 8x8 outputs; slower on 4x4 outputs with 512 channels)."""


def _use_shifted_views(layer, delta: Tensor) -> bool:
    positions = delta.shape[1] * delta.shape[2] if None not in delta.shape[1:3] else 0
    return positions >= SHIFTED_MIN_POSITIONS and tuple(layer.dilation_rate) == (1, 1)


def _padded_input(layer, inputs: Tensor, dtype) -> Tensor:
    """The input padded exactly as the forward convolution pads it."""
    (kh, kw), (sh, sw) = tuple(layer.kernel_size), tuple(layer.strides)
    padding = layer.padding.upper()
    _, pad_h = _output_size_and_padding(static_or_dynamic(inputs, 1), kh, sh, 1, padding)
    _, pad_w = _output_size_and_padding(static_or_dynamic(inputs, 2), kw, sw, 1, padding)
    return pad_like_convolution(tf.cast(inputs, dtype), pad_h, pad_w)


def _kernel_grads_shifted(layer, inputs: Tensor, delta: Tensor) -> Tensor:
    """``dL_i/dK[u, v] = V_uv(a~_i)^T delta_i`` per kernel offset ``(u, v)``.

    ``V_uv(a~)[h, w] = a~[s h + u, s w + v]`` is the strided view of the padded
    input that kernel tap ``(u, v)`` sees; stacking the ``kh*kw`` products in
    ``(u, v, c_in)`` order gives the ``[B, kh*kw*c_in, c]`` of the im2col form.
    """
    (kh, kw), (sh, sw) = tuple(layer.kernel_size), tuple(layer.strides)
    a = _padded_input(layer, inputs, delta.dtype)
    out_h, out_w = delta.shape[1], delta.shape[2]
    batch = tf.shape(delta)[0]
    flat_delta = tf.reshape(delta, [batch, -1, delta.shape[-1]])
    per_offset = []
    for u in range(kh):
        for v in range(kw):
            view = a[:, u : u + (out_h - 1) * sh + 1 : sh, v : v + (out_w - 1) * sw + 1 : sw, :]
            view = tf.reshape(view, [batch, -1, a.shape[-1]])
            per_offset.append(tf.matmul(view, flat_delta, transpose_a=True))
    return tf.concat(per_offset, axis=1) if len(per_offset) > 1 else per_offset[0]


DEPTHWISE_MAX_ROWS = 4
"""Up to this many output channels, per-example kernel gradients use one depthwise
correlation per channel instead of im2col patches (measured on 2 CPU cores:
a multiplier-1 depthwise correlation costs about a ninth of materialising the
patches of a 3x3 layer, so a few rows -- SPARTA's sparse phase at low
density -- are several times cheaper)."""


def _use_depthwise(layer, channels: int | None) -> bool:
    return (
        channels is not None
        and channels <= DEPTHWISE_MAX_ROWS
        and tuple(layer.dilation_rate) == (1, 1)
        and tuple(layer.kernel_size) != (1, 1)
    )


def _kernel_grads_depthwise(layer, inputs: Tensor, delta: Tensor) -> Tensor:
    """Per-example kernel gradients as depthwise correlations of inputs with output gradients.

    With the input padded as the forward convolution pads it, ``a~``, stride ``s``::

        dL_i/dK[u, v, c, r] = sum_{h,w} a~_i[s h + u, s w + v, c] delta_i[h, w, r]

    which is a depthwise correlation of ``a~`` laid out ``[c, H, W, B]`` (channels
    = examples) with the filter ``delta[..., r]`` laid out ``[H', W', B, 1]``,
    dilated by ``s``; its ``VALID`` output is exactly ``[c, kh, kw, B]``.
    """
    (kh, kw), (sh, sw) = tuple(layer.kernel_size), tuple(layer.strides)
    x = tf.transpose(_padded_input(layer, inputs, delta.dtype), [3, 1, 2, 0])  # [c_in, Hp, Wp, B]
    filters = tf.transpose(delta, [1, 2, 0, 3])  # [H', W', B, rows]
    per_row = [
        tf.nn.depthwise_conv2d(x, filters[..., r : r + 1], [1, 1, 1, 1], "VALID", dilations=[sh, sw])[:, :kh, :kw, :]
        for r in range(delta.shape[-1])
    ]
    grads = tf.stack(per_row, axis=-1)  # [c_in, kh, kw, B, rows]
    grads = tf.transpose(grads, [3, 1, 2, 0, 4])  # [B, kh, kw, c_in, rows]
    return tf.reshape(grads, [tf.shape(delta)[0], -1, delta.shape[-1]])


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


def _selected_rows(delta: Tensor, selection) -> Tensor:
    """The output channels of ``delta`` that a rows selection trains (all otherwise)."""
    if selection.kind == "rows":
        return tf.gather(delta, selection.rows, axis=-1)
    return delta


def _finish(grads: Tensor, selection, rows_compact: bool) -> Tensor:
    """Per-example gradients in the selection's compact form (``rows_compact``: rows already are)."""
    if selection.kind == "entries" or (selection.kind == "rows" and not rows_compact):
        return selection.compact(grads, batch_dims=1)
    return grads


DENSE_RULE = DenseRule()
CONV2D_RULE = Conv2DRule()
VJP_RULE = VjpRule()
PRE_ACTIVATION_VJP_RULE = VjpRule("pre_activation")
