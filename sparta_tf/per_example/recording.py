"""Recording forward pass: layer inputs and output-gradient probes.

To get every example's output gradient ``delta_i = dL_i/dz_i`` of a layer
from one batched backward pass, the layer's output ``z`` is replaced by
``z + p`` where ``p = 0`` is a watched tensor (a *probe*): the value is
unchanged and ``d(sum_i L_i)/dp = [dL_1/dz_1, ..., dL_B/dz_B]`` because no
layer mixes examples. The layer's inputs are kept so that a
:class:`~sparta_tf.per_example.rules.base.LayerRule` can turn
``(inputs, delta)`` into per-example weight gradients.

Hooks are installed once per layer (as instance attributes, so other
instances and the class are untouched) and are inert outside a
:func:`recording` context: the plain model, its SavedModel export and
inference are unaffected.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Iterator

import tensorflow as tf

from sparta_tf.per_example.errors import UnsupportedLayerError
from sparta_tf.per_example.rules.base import LayerRule, RecordedCall

_STATE = threading.local()
_HOOK_ATTRIBUTE = "_sparta_per_example_hook"


class Recording:
    """The probes and inputs of one recording forward pass."""

    def __init__(self, tape: tf.GradientTape, layers: set[int], streaming=None):
        self.tape = tape
        self.layer_ids = layers
        self.calls: list[RecordedCall] = []
        self.streaming = streaming  # a two-pass step's taps (sparta_tf.per_example.streaming), or None

    def probe(self, layer, args, kwargs, output, original_call):
        """``output`` with a zero probe added to each floating-point tensor in it (recorded)."""
        leaves = tf.nest.flatten(output)
        positions = [k for k, t in enumerate(leaves) if isinstance(t, tf.Tensor) and t.dtype.is_floating]
        if not positions:
            raise UnsupportedLayerError(
                f"layer {layer.name!r} ({type(layer).__name__}) owns trainable weights but returns no "
                "floating-point tensor, so no output gradient can reach them; make it return its output tensor")
        probes = [tf.zeros_like(leaves[k]) for k in positions]
        self.tape.watch(probes)
        single = isinstance(output, tf.Tensor)
        self.calls.append(RecordedCall(layer, args, kwargs, probes[0] if single else probes, original_call,
                                       output_positions=None if single else positions))
        probed = list(leaves)
        for k, probe in zip(positions, probes):
            probed[k] = leaves[k] + probe
        if single and self.streaming is not None and id(layer) in self.streaming.rules:
            probed[0] = self.streaming.tap(self, self.calls[-1], probed[0])
        return probed[0] if single else tf.nest.pack_sequence_as(output, probed)


def _active_recording_for(layer) -> Recording | None:
    recording_ = getattr(_STATE, "recording", None)
    if recording_ is None or id(layer) not in recording_.layer_ids:
        return None
    return recording_


@contextlib.contextmanager
def recording(tape: tf.GradientTape, layers, streaming=None) -> Iterator[Recording]:
    """Within this context, calls of hooked ``layers`` are recorded on ``tape`` (with ``streaming``:
    their single-tensor outputs also go through its taps)."""
    if getattr(_STATE, "recording", None) is not None:
        raise RuntimeError("per-example recordings cannot be nested")
    _STATE.recording = Recording(tape, {id(layer) for layer in layers}, streaming)
    try:
        yield _STATE.recording
    finally:
        _STATE.recording = None


def install_hook(layer: tf.keras.layers.Layer, rule: LayerRule) -> None:
    """Wraps ``layer`` so that recording passes probe it where ``rule`` needs (``rule.record``)."""
    if getattr(layer, _HOOK_ATTRIBUTE, None) is not None:
        return
    method_name = "convolution_op" if rule.probe_point == "convolution" else "call"
    original = getattr(layer, method_name)

    def hooked(*args, **kwargs):
        active = _active_recording_for(layer)
        if active is None:
            return original(*args, **kwargs)
        return rule.record(active, layer, original, args, kwargs)

    object.__setattr__(layer, method_name, hooked)
    object.__setattr__(layer, _HOOK_ATTRIBUTE, rule)


def install_reshape_hook(wrapper: tf.keras.layers.TimeDistributed) -> None:
    """Makes ``wrapper`` apply its inner layer to ``[B*T, ...]`` rows in recording passes
    (:func:`apply_to_rows`); outside recording passes the wrapper is untouched.

    Keras runs the inner layer of a ``TimeDistributed`` once per time step (Keras 3 with a static
    ``T``; Keras 2 with a static batch size and a custom layer inside) or inside a loop
    (``while_loop``, ``vectorized_map``) where no probe can be read from outside. One call on the
    ``B*T`` rows computes the same values, which the engine then groups back by example.
    """
    if getattr(wrapper, _HOOK_ATTRIBUTE, None) is not None:
        return
    original = wrapper.call

    def hooked(inputs, *args, **kwargs):
        if getattr(_STATE, "recording", None) is None:
            return original(inputs, *args, **kwargs)
        return apply_to_rows(wrapper, inputs, *args, **kwargs)

    object.__setattr__(wrapper, "call", hooked)
    object.__setattr__(wrapper, _HOOK_ATTRIBUTE, "reshape")


def _merge_steps(t: tf.Tensor) -> tf.Tensor:
    """``[B, T, *S] -> [B*T, *S]`` (row ``i*T + t`` is example ``i``'s step ``t``; ``S`` static where known)."""
    tail = [d if d is not None else tf.shape(t)[k + 2] for k, d in enumerate(t.shape[2:])]
    return tf.reshape(t, [-1, *tail])


def _split_steps(t: tf.Tensor, batch, steps) -> tf.Tensor:
    """``[B*T, *S] -> [B, T, *S]``, the inverse of :func:`_merge_steps`."""
    tail = [d if d is not None else tf.shape(t)[k + 1] for k, d in enumerate(t.shape[1:])]
    return tf.reshape(t, [batch, steps, *tail])


def apply_to_rows(wrapper, inputs, training=None, mask=None):
    """``y[i, t] = layer(x[i, t])`` as one call of the inner layer on the ``B*T`` rows of ``inputs``
    (``mask[i, t]`` its mask, where the inner layer's call takes one)."""
    leaves = tf.nest.flatten(inputs)
    if any(not isinstance(t, tf.Tensor) for t in leaves):
        raise UnsupportedLayerError(
            f"TimeDistributed layer {wrapper.name!r} takes a {type(leaves[0]).__name__} input, which "
            "per-example gradients do not support; pass dense tensors (with a mask)")
    first = leaves[0]
    batch = first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]
    steps = first.shape[1] if first.shape[1] is not None else tf.shape(first)[1]
    inner = wrapper.layer
    parameters = inspect.signature(inner.call).parameters
    kwargs = {}
    if "training" in parameters:
        kwargs["training"] = training
    if mask is not None and "mask" in parameters:
        kwargs["mask"] = _merge_steps(tf.convert_to_tensor(mask))
    outputs = inner(tf.nest.map_structure(_merge_steps, inputs), **kwargs)
    return tf.nest.map_structure(lambda t: _split_steps(t, batch, steps), outputs)
