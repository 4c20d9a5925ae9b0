"""Recording forward pass: layer inputs and output-gradient probes.

To get every example's output gradient ``delta_i = dL_i/dz_i`` of a layer
from one batched backward pass, the layer's output ``z`` is replaced by
``z + p`` where ``p = 0`` is a watched tensor (a *probe*): the value is
unchanged and ``d(sum_i L_i)/dp = [dL_1/dz_1, ..., dL_B/dz_B]`` because no
layer mixes examples. The layer's inputs are kept so that a
:class:`~sparta_tf.per_example.layer_rules.LayerRule` can turn
``(inputs, delta)`` into per-example weight gradients.

Hooks are installed once per layer (as instance attributes, so other
instances and the class are untouched) and are inert outside a
:func:`recording` context: the plain model, its SavedModel export and
inference are unaffected.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import tensorflow as tf

from sparta_tf.per_example.layer_rules import LayerRule, RecordedCall

_STATE = threading.local()
_HOOK_ATTRIBUTE = "_sparta_per_example_hook"


class Recording:
    """The probes and inputs of one recording forward pass."""

    def __init__(self, tape: tf.GradientTape, layers: set[int]):
        self.tape = tape
        self.layer_ids = layers
        self.calls: list[RecordedCall] = []

    def probe(self, layer, args, kwargs, output, original_call) -> tf.Tensor:
        probe = tf.zeros_like(output)
        self.tape.watch(probe)
        self.calls.append(RecordedCall(layer, args, kwargs, probe, original_call))
        return output + probe


def _active_recording_for(layer) -> Recording | None:
    recording_ = getattr(_STATE, "recording", None)
    if recording_ is None or id(layer) not in recording_.layer_ids:
        return None
    return recording_


@contextlib.contextmanager
def recording(tape: tf.GradientTape, layers) -> Iterator[Recording]:
    """Within this context, calls of hooked ``layers`` are recorded on ``tape``."""
    if getattr(_STATE, "recording", None) is not None:
        raise RuntimeError("per-example recordings cannot be nested")
    _STATE.recording = Recording(tape, {id(layer) for layer in layers})
    try:
        yield _STATE.recording
    finally:
        _STATE.recording = None


def install_hook(layer: tf.keras.layers.Layer, rule: LayerRule) -> None:
    """Wraps ``layer`` so that recording passes probe it where ``rule`` needs."""
    if getattr(layer, _HOOK_ATTRIBUTE, None) is not None:
        return
    method_name = "convolution_op" if rule.probe_point == "convolution" else "call"
    original = getattr(layer, method_name)

    def hooked(*args, **kwargs):
        output = original(*args, **kwargs)
        active = _active_recording_for(layer)
        if active is None:
            return output
        if not isinstance(output, tf.Tensor):
            raise TypeError(
                f"layer {layer.name!r} returned {type(output).__name__}; per-example "
                "gradients by layer need a single tensor output (use engine='vectorized')"
            )
        return active.probe(layer, args, kwargs, output, original)

    object.__setattr__(layer, method_name, hooked)
    object.__setattr__(layer, _HOOK_ATTRIBUTE, rule)
