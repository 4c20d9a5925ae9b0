"""Per-example gradients, norms and clipped sums: per-layer rules from a public registry, and engines.

* :func:`register_layer_rule` gives a layer class a rule (:class:`LayerRule`: per-example
  gradients; :class:`GhostRule`: norms and clipped sums without them); the built-in rules, one
  module per layer family under :mod:`sparta_tf.per_example.rules`, are registered the same way
  when this package is imported. A layer without a rule gets the generic per-example VJP of its
  own call (exact, slower). Guide: docs/add-a-layer-rule.md.
* :func:`make_engine` picks the engine of a DP step (:mod:`sparta_tf.per_example.factory`).
"""

from sparta_tf.per_example.registry import ghost_rule_for, register_layer_rule, rule_for
from sparta_tf.per_example.rules import (  # noqa: F401  (registers the built-in rules)
    convolution,
    conv2d,
    dense,
    depthwise,
    einsum,
    embedding,
    normalization,
    prelu,
    recurrent,
    transposed,
)
from sparta_tf.per_example.rules.base import GhostRule, LayerRule, NormMethod, RecordedCall, VjpRule
from sparta_tf.per_example.errors import UnsupportedLayerError
from sparta_tf.per_example.bookkeeping import BookkeepingEngine
from sparta_tf.per_example.engines import LayerwiseEngine, PerExampleGradients, VectorizedEngine
from sparta_tf.per_example.factory import ENGINES, make_engine

__all__ = [
    "BookkeepingEngine",
    "ENGINES",
    "GhostRule",
    "LayerRule",
    "LayerwiseEngine",
    "NormMethod",
    "PerExampleGradients",
    "RecordedCall",
    "UnsupportedLayerError",
    "VectorizedEngine",
    "VjpRule",
    "ghost_rule_for",
    "make_engine",
    "register_layer_rule",
    "rule_for",
]
