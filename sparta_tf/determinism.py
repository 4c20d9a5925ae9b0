"""Bit-reproducible runs on one machine: the same seed, config and hardware give the same bits.

What a seed already fixes (:mod:`sparta_tf.random_streams`): the Poisson
batches, the Gaussian noise and every other random choice, exactly. What it
does not fix without this module is the floating-point arithmetic in
between. TensorFlow's graph optimiser (Grappler) rewrites each traced
function before it runs (fusing ops, regrouping sums); those rewrites can
differ between two processes running the same function, and a regrouped sum
rounds differently. Measured on this project's 2-core CPU VM (SPARTA,
ResNet-20-GN, 3 epochs, the same config and seed in fresh processes): two
runs differed in the 7th digit of the loss within the first epoch, with or
without TensorFlow's op determinism and oneDNN; with Grappler's rewrites off
the runs were bit-identical. The drift grows with training: two 20-epoch
runs that share every step until SPARTA's selection epoch (SPARTA and the
row oracle, same seed) were up to half a point of validation accuracy apart
by then.

:func:`make_deterministic` turns the rewrites off (``disable_meta_optimizer``)
and enables TensorFlow's op determinism, which makes ops that have a
deterministic kernel use it (on GPU, e.g. convolution backprop) and makes
ops without one raise an error instead of drifting silently. Both settings
are process-wide and must be set before the first ``tf.function`` is traced.
Results then match bit for bit only on the same hardware, TensorFlow build
and thread count; across CPUs they still differ.
"""

from __future__ import annotations

import tensorflow as tf


def make_deterministic() -> None:
    """Turns off Grappler's graph rewrites and enables TensorFlow op determinism, process-wide."""
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    tf.config.experimental.enable_op_determinism()
