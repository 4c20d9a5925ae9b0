"""The pre-flight checks' shared pieces: one traced pass on a few real examples, and the bound.

:mod:`~sparta_tf.per_example.coverage` (sums of per-example gradients against the batch gradient)
and :mod:`~sparta_tf.per_example.rule_check` (a user rule against the one-example tape gradient)
both run a computation traced, as the DP step is, in a replica context of the strategy, and
compare a result with its truth by::

    || ours - truth ||  <=  tol ||truth||  +  atol,     atol = ABSOLUTE_FRACTION * (scale of the truths)
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

ABSOLUTE_FRACTION = 1e-5
"""``atol`` as a fraction of the largest truth (for truths that are zero)."""


def traced_on_first_replica(strategy: tf.distribute.Strategy, computation: Callable, x, y):
    """``computation(x, y)`` traced and run by ``strategy`` (mirrored variables are differentiated in a
    replica context), its results on the first replica. Traced, as the DP step is: a layer called
    inside a ``tf.while_loop`` is recorded once per step in eager mode but cannot be probed from
    outside the loop in a graph."""
    results = tf.function(lambda x, y: strategy.run(computation, args=(x, y)))(x, y)
    return tf.nest.map_structure(lambda t: strategy.experimental_local_results(t)[0], results)


def within_bound(ours, truth, tol: float, atol: float) -> tuple[bool, float]:
    """``(||ours - truth|| <= tol ||truth|| + atol, the relative error)``; a shape mismatch fails."""
    ours, truth = np.asarray(ours, np.float64), np.asarray(truth, np.float64)
    if ours.shape != truth.shape:
        return False, float("inf")
    error, size = float(np.linalg.norm(ours - truth)), float(np.linalg.norm(truth))
    return error <= tol * size + atol, error / max(size, 1e-30)
