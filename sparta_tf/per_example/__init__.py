"""Per-example gradients: layer-wise rules and a generic vectorized_map engine."""

from sparta_tf.per_example.engines import (
    LayerwiseEngine,
    PerExampleGradients,
    VectorizedEngine,
    make_engine,
)

__all__ = ["LayerwiseEngine", "PerExampleGradients", "VectorizedEngine", "make_engine"]
