"""Coverage: every trained variable is seen, exactly, by the per-example rule of its layer.

The book-keeping and layer-wise engines see a variable only through the
recorded calls of the layer that owns it (:mod:`sparta_tf.per_example.recording`).
A variable the model also uses some other way -- read by another layer, used in
a ``tf.while_loop`` or by a layer whose ``call`` Keras bypasses (as LSTM and GRU
bypass their cell's) -- would be missing from the per-example norms, in whole
or in part: it would be trained by noise alone, or with a gradient that is not
the one clipped, while the run looks fine. Layers with random ops inside their
own call are not re-run exactly either.

So before the first DP step, on a few real examples, the engine's per-example
gradients summed without clipping must equal the batch gradient of the same
forward pass (traced, like the step), for every variable::

    || sum_i g_i - dL/dW ||  <=  tol ||dL/dW||  +  atol

(``atol`` 1e-5 of the largest batch gradient, for variables whose gradient is
zero). ``tol`` is 1e-3 in float32 and float64. When a layer computes in
bfloat16 or float16 the batch gradient itself rounds in that dtype (a bias
gradient summed over 260 rows in bfloat16 was off by 11% from the float32
sum of the same terms on a small ViT), so ``tol`` is 64 unit roundoffs of the
lowest compute dtype: 0.25 in bfloat16, 0.031 in float16. A variable outside
the bound is refused with one line naming it, its layer and what to do. An
uncovered variable is off by 100%; in bfloat16 a variable missing less than a
quarter of its gradient could pass (every rule is tested exactly in float32
by ``tests/test_layer_zoo.py``). The whole-model ``vectorized`` engine needs
no check: it differentiates the model itself, one example at a time.

A rule a user registers (:func:`~sparta_tf.per_example.registry.register_layer_rule`) is checked
first and more strictly, per example: :mod:`~sparta_tf.per_example.rule_check`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.keras_layers import all_layers
from sparta_tf.per_example.errors import UnsupportedLayerError
from sparta_tf.per_example.probe import ABSOLUTE_FRACTION, traced_on_first_replica, within_bound
from sparta_tf.per_example.rule_check import check_user_rules

FLOAT_TOLERANCE = 1e-3
ROUNDOFFS = 64
PROBE_EXAMPLES = 4


UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def tolerance(model: tf.keras.Model) -> float:
    """``max(1e-3, 64 u)`` with ``u`` the unit roundoff of the model's lowest compute dtype."""
    roundoffs = [UNIT_ROUNDOFF.get(getattr(layer, "compute_dtype", None), 0.0)
                 for layer in all_layers(model)]
    return max([FLOAT_TOLERANCE] + [ROUNDOFFS * u for u in roundoffs])


def _owners(engine) -> dict[int, str]:
    return {k: layer.name for layer, _, indices in engine.plan for k in indices}


def _traced_sums(engine, x, y, loss_fn, strategy):
    """``(sum_i g_i, batch gradient)`` per selection from one traced pass on the first replica's data
    (:func:`~sparta_tf.per_example.probe.traced_on_first_replica`)."""

    def computation(x, y):
        valid = tf.ones(tf.shape(tf.nest.flatten(x)[0])[:1], tf.bool)
        sums, batch_gradients = engine.coverage_sums(x, y, loss_fn, valid)
        unconnected = [tf.zeros(s.variable.shape, s.variable.dtype) if g is None else tf.convert_to_tensor(g)
                       for s, g in zip(engine.selections, batch_gradients)]
        return sums, unconnected

    return traced_on_first_replica(strategy, computation, x, y)


def check_coverage(engine, x, y, loss_fn, strategy: tf.distribute.Strategy | None = None) -> None:
    """Raises :class:`UnsupportedLayerError` unless the engine's per-example gradients of the
    examples ``x, y`` (a few real ones, no padding) add up to their batch gradient (module doc),
    after checking every registered user rule of the engine's plan against the one-example tape
    gradient (:func:`~sparta_tf.per_example.rule_check.check_user_rules`)."""
    if not hasattr(engine, "coverage_sums"):
        return
    x = tf.nest.map_structure(lambda t: tf.convert_to_tensor(t[:PROBE_EXAMPLES]), x)
    y = tf.nest.map_structure(lambda t: tf.convert_to_tensor(t[:PROBE_EXAMPLES]), y)
    strategy = strategy or tf.distribute.get_strategy()
    check_user_rules(engine, x, y, loss_fn, strategy, tolerance(engine.model))
    sums, batch_gradients = _traced_sums(engine, x, y, loss_fn, strategy)
    truths = [np.asarray(s.compact(g), np.float64) for s, g in zip(engine.selections, batch_gradients)]
    scale = max((np.linalg.norm(t) for t in truths), default=0.0)
    relative_bound = tolerance(engine.model)
    owners = _owners(engine)
    for k, (selection, ours, truth) in enumerate(zip(engine.selections, sums, truths)):
        ok, relative = within_bound(ours, truth, relative_bound, ABSOLUTE_FRACTION * scale)
        if not ok:
            raise UnsupportedLayerError(
                f"per-example gradients of variable {variable_key(selection.variable)!r} (layer "
                f"{owners.get(k, '?')!r}) do not add up to its batch gradient (relative error {relative:.2g}): "
                "the variable is used outside its layer's own call (by another layer, in a loop, or with "
                "random ops inside the layer), so its per-example norms would be wrong; use a supported layer "
                "(see the layer table in docs/layers.md) or engine='vectorized'")
