"""Per-example gradients of recurrent layers: LSTM, GRU, SimpleRNN, ``RNN(cell)`` and Bidirectional.

Keras's LSTM and GRU do not call their cell's ``call`` (they run a fused
kernel on the cell's weights), and every RNN runs its steps inside a
``while_loop`` whose intermediate values no probe can be read from outside.
So a recurrent layer is treated as one unit: in a recording pass its call is
replaced by the same recurrence run step by step through ``cell.__call__``
(Keras's ``backend.rnn``, as ``keras.layers.RNN.call`` does, with the
layer's mask, ``go_backwards``, ``time_major`` (Keras 2), initial state and
``zero_output_for_mask``), where step ``t`` adds zero probes ``p_t`` to the
cell's output and new states, and records its inputs ``x_t`` and previous
states ``s_{t-1}``.

With ``delta_t = dL/dp_t`` (the *total* derivative of the loss with respect to
step ``t``'s results, through every later step), the per-example gradient of
the cell's weights ``W`` is the sum over steps of the cell's own VJP at fixed
inputs::

    dL_i/dW = sum_t  delta_{i,t}^T  d cell(x_{i,t}, s_{i,t-1}; W) / dW

computed, vectorised over examples, as one re-run of the cell per example on
its ``T`` steps as a batch of ``T`` rows with ``output_gradients = delta_i``
(the batched VJP sums over the rows). Masked steps have ``delta_t = 0`` and add
nothing. The result is exact for any cell whose call is a deterministic
function of its inputs and states.

Refused with one line: stateful layers (the state carries data across
batches, so across examples), cells with ``dropout`` / ``recurrent_dropout``
(their random masks cannot be replayed in the re-run; a ``Dropout`` layer
before the RNN is fine), ``constants``, nested and ragged inputs.
"""

from __future__ import annotations

import inspect

import tensorflow as tf

from sparta_tf.backend import rnn_initial_state, rnn_loop, tf_variable
from sparta_tf.keras_layers import all_layers
from sparta_tf.per_example.errors import UnsupportedLayerError
from sparta_tf.per_example.registry import register_layer_rule
from sparta_tf.per_example.rules.base import LayerRule, RecordedCall
from sparta_tf.precision import to_accumulation

RNN = tf.keras.layers.RNN


def is_recurrent(layer) -> bool:
    return isinstance(layer, RNN)


def cell_layers(layer: RNN) -> list:
    """The recurrent layer's cell and every layer inside it (e.g. the cells of StackedRNNCells)."""
    cell = layer.cell
    inner = all_layers(cell) if hasattr(cell, "_flatten_layers") else []
    return [cell, *inner]


def check_recurrent_layer(layer: RNN) -> None:
    """Raises :class:`UnsupportedLayerError` for what the recurrent rule cannot make exact."""
    if getattr(layer, "stateful", False):
        raise UnsupportedLayerError(
            f"recurrent layer {layer.name!r} is stateful: its state carries one batch's data into the "
            "next, so no example's contribution is its own; use stateful=False")
    for cell in cell_layers(layer):
        for option in ("dropout", "recurrent_dropout"):
            if getattr(cell, option, 0):
                raise UnsupportedLayerError(
                    f"recurrent layer {layer.name!r} has {option}={getattr(cell, option)}: the per-example "
                    "re-run of its cell cannot replay the random dropout masks; set dropout=0 and "
                    "recurrent_dropout=0 (a Dropout layer before the recurrent layer is supported)")


def _arguments(layer, args, kwargs) -> dict:
    """The call's arguments by name; the sequence (``inputs`` on Keras 2, ``sequences`` on Keras 3)
    under ``"inputs"``."""
    signature = inspect.signature(type(layer).call)
    arguments = dict(signature.bind(layer, *args, **kwargs).arguments)
    first = list(signature.parameters)[1]
    arguments["inputs"] = arguments.pop(first, None)
    return arguments


def _time_major(layer) -> bool:
    return bool(getattr(layer, "time_major", False))  # Keras 2 only; Keras 3's RNNs are batch-major


def _zeros_per_step(sequence: tf.Tensor, step_value: tf.Tensor) -> tf.Tensor:
    """Zeros ``[B, T, *step_value.shape[1:]]`` (static where known)."""
    tail = step_value.shape[1:]
    tail = tail.as_list() if tail.is_fully_defined() else tf.shape(step_value)[1:]
    return tf.zeros(tf.concat([tf.shape(sequence)[:2], tail], 0), step_value.dtype)


def _flat(states) -> list:
    """A cell's states as a flat list (StackedRNNCells nests them per cell, and re-nests a flat list)."""
    return tf.nest.flatten(states)


def _cell_on_flat_states(cell, structure):
    """``cell.__call__`` taking its states as a flat list (re-nested like ``structure``, the layer's
    initial state: Keras 3's StackedRNNCells takes one entry per cell) and returning them as given."""
    def run(x, states, **kwargs):
        return cell(x, tf.nest.pack_sequence_as(structure, list(states)), **kwargs)
    return run


class RecurrentRule(LayerRule):
    """The recurrent rule (see module doc); ``RecordedCall.args = (x [B, T, ...], [s_{t-1} [B, T, ...]])``,
    ``probe = [p_output, *p_states]`` in processing order (reversed for ``go_backwards``)."""

    probe_point = "recurrent"
    norm_method = "recurrent"

    def record(self, recording, layer, original_call, args, kwargs):
        arguments = _arguments(layer, args, kwargs)
        inputs = arguments.get("inputs")
        if arguments.get("constants") is not None:
            raise UnsupportedLayerError(f"recurrent layer {layer.name!r} is called with constants, which "
                                        "per-example gradients do not support; pass them as inputs instead")
        if isinstance(inputs, tf.RaggedTensor) or tf.nest.is_nested(inputs):
            raise UnsupportedLayerError(f"recurrent layer {layer.name!r} takes ragged or nested inputs, which "
                                        "per-example gradients do not support; pass one dense tensor with a mask")
        initial_state = arguments.get("initial_state")
        if initial_state is None:
            initial_state = rnn_initial_state(layer, inputs)
        initial_state = list(initial_state) if isinstance(initial_state, (list, tuple)) else [initial_state]
        if _time_major(layer):
            inputs = tf.transpose(inputs, [1, 0] + list(range(2, inputs.shape.rank)))
        mask = arguments.get("mask")
        mask = None if mask is None else tf.nest.flatten(mask)[0]
        if mask is not None and _time_major(layer):
            mask = tf.transpose(mask)  # [T, B] for time-major inputs; the recurrence below is batch-major
        cell = layer.cell
        cell_kwargs = {}
        if "training" in inspect.signature(cell.call).parameters:
            cell_kwargs["training"] = arguments.get("training")
        run_cell = _cell_on_flat_states(cell, initial_state)
        states = _flat(initial_state)

        first_output, first_states = run_cell(inputs[:, 0], states, **cell_kwargs)  # shapes only (pruned)
        probes = [_zeros_per_step(inputs, t) for t in [first_output, *_flat(first_states)]]
        recording.tape.watch(probes)
        fed = [tf.reverse(p, [1]) for p in probes] if layer.go_backwards else probes  # step t sees probes[:, t]

        def step(step_inputs, previous):
            x_t, probes_t = step_inputs
            previous = list(previous)
            output, new_states = run_cell(x_t, previous, **cell_kwargs)
            new_states = [s + p for s, p in zip(_flat(new_states), probes_t[1:])]
            return (output + probes_t[0], x_t, *previous), new_states

        last, sequences, final_states = rnn_loop(
            step, (inputs, fed), states, go_backwards=layer.go_backwards, mask=mask, unroll=False,
            input_length=inputs.shape[1], time_major=False, zero_output_for_mask=layer.zero_output_for_mask,
            return_all_outputs=True)
        output_sequence, x_sequence, *state_sequences = sequences
        recording.calls.append(RecordedCall(layer, (x_sequence, state_sequences), cell_kwargs, probes, run_cell))
        if layer.return_sequences:
            output = output_sequence
            if _time_major(layer):
                output = tf.transpose(output, [1, 0] + list(range(2, output.shape.rank)))
        else:
            output = last[0]
        if layer.return_state:
            return [output, *tf.nest.pack_sequence_as(initial_state, _flat(final_states))]
        return output

    def per_example_grads(self, layer, call, delta, selections):
        variables = [tf_variable(s.variable) for s in selections]
        x_sequence, state_sequences = call.args
        delta = [tf.cast(d, p.dtype) for d, p in zip(delta, call.probe)]

        def one_example(elems):
            x_i, states_i, delta_i = elems  # the example's T steps act as a batch of T rows
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(variables)
                output, new_states = call.original_call(x_i, list(states_i), **call.kwargs)
            grads = tape.gradient([output, *_flat(new_states)], variables, output_gradients=delta_i,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [to_accumulation(tf.convert_to_tensor(g)) for g in grads]

        full = tf.vectorized_map(one_example, (x_sequence, state_sequences, delta))
        return [s.compact(g, batch_dims=1) for s, g in zip(selections, full)]


RECURRENT_RULE = RecurrentRule()
register_layer_rule(RNN, RECURRENT_RULE, subclasses=True, verify=False)  # LSTM, GRU, SimpleRNN, RNN(cell)
