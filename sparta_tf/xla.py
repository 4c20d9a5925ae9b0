"""When to compile the DP train step with XLA.

On CPU, ``tf.vectorized_map`` per-example gradients under ``jit_compile=True``
are 3-4x slower than without (measured on the 2-core machines this project is
developed on), so ``"auto"`` enables XLA only when a GPU or TPU is visible.
"""

from __future__ import annotations

from typing import Union

import tensorflow as tf

JitCompile = Union[bool, str]


def resolve_jit_compile(jit_compile: JitCompile) -> bool:
    """``"auto"`` -> True on GPU/TPU, False on CPU; booleans pass through."""
    if isinstance(jit_compile, bool):
        return jit_compile
    if jit_compile != "auto":
        raise ValueError(f"jit_compile={jit_compile!r}: use 'auto', True or False")
    accelerators = tf.config.list_logical_devices("GPU") + tf.config.list_logical_devices("TPU")
    return bool(accelerators)
