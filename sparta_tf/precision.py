"""The matmul precision that the clip bound relies on.

The ghost and index-equality norms (:func:`sparta_tf.per_example.rules.ghost_norms.gram_squared_norms`)
add a bound on their own rounding error, ``2 gamma_n R_i^2`` with the unit roundoff ``u`` of
IEEE arithmetic in the Grams' dtype (``2^-24`` for float32). TensorFloat-32 matmuls, which
TensorFlow turns on by default on Ampere and newer NVIDIA GPUs, round their inputs to 10
mantissa bits (``u = 2^-11``): there a crafted example whose positions nearly cancel could
still come out below its true squared norm and escape clipping. So every DP step turns
TensorFloat-32 off for the process before it is traced.

Cost: float32 matmuls and convolutions of the whole process run in full float32 on such GPUs
(slower than TF32; nothing changes on CPUs or older GPUs). Not covered: TPUs, whose default
float32 matmul precision multiplies in bfloat16 (``u = 2^-8``) whatever this flag says.
"""

from __future__ import annotations

import logging

import tensorflow as tf

logger = logging.getLogger(__name__)


def require_ieee_float32_matmuls() -> None:
    """Turns TensorFloat-32 execution off (process-wide, idempotent).

    Logs once per switch when a GPU is visible, where the switch can slow matmuls down.
    Re-enabling TF32 after a DP step was traced is not undone until the next trace: XLA steps
    keep the precision they were compiled with, but non-XLA GPU kernels read the flag each time
    they run, so they would use TF32 again. Do not re-enable it in a process that trains with DP
    (this also means non-private baselines timed in the same process run in full float32).
    """
    if not tf.config.experimental.tensor_float_32_execution_enabled():
        return
    tf.config.experimental.enable_tensor_float_32_execution(False)
    if tf.config.list_logical_devices("GPU"):
        logger.warning(
            "TensorFloat-32 turned off: the DP clip bound assumes IEEE float32 matmuls "
            "(see sparta_tf.precision)"
        )


def accumulation_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype per-example norms, clip factors and clipped sums are computed in: float64 for a
    float64 model, else float32 whatever the compute dtype.

    A bfloat16 or float16 norm rounds with ``u = 2^-9`` or ``2^-11``, so one example's clipped
    contribution could exceed ``C`` by that much (measured: 1.0057 C in bfloat16, 1.036 C in
    float16), and a float16 square above 65504 overflows to inf, which would drop the example
    instead of clipping it. Output gradients and layer inputs are exact in float32 (every
    bfloat16 / float16 value is a float32 value), so casting them up first computes the norm of
    the very gradient that is summed, with float32 rounding, which the safety margin of
    :mod:`sparta_tf.dp_step.clipping` and the ghost norms' rounding bound already cover.
    """
    dtype = tf.as_dtype(dtype)
    return tf.float64 if dtype == tf.float64 else tf.float32


def is_low_precision(tensors) -> bool:
    """Whether any tensor of ``tensors`` (any structure) is of a floating dtype narrower than float32
    (bfloat16, float16): what a layer computes in under a mixed-precision policy."""
    return any(t.dtype not in (tf.float32, tf.float64) for t in tf.nest.flatten(tensors))


def to_accumulation(t: tf.Tensor) -> tf.Tensor:
    """``t`` cast to :func:`accumulation_dtype` (floating tensors only; others unchanged)."""
    if not t.dtype.is_floating:
        return t
    return tf.cast(t, accumulation_dtype(t.dtype))
