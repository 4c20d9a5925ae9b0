"""Optimizers for DP training on trainable subsets, and learning-rate schedules."""

from sparta_tf.optim.masked_optimizer import MaskedOptimizer
from sparta_tf.optim.schedules import cosine_with_warmup

__all__ = ["MaskedOptimizer", "cosine_with_warmup"]
