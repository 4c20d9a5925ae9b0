"""Optimizers for DP training on trainable subsets, learning-rate schedules, and weight averaging."""

from sparta_tf.optim.masked_optimizer import MaskedOptimizer
from sparta_tf.optim.schedules import cosine_with_warmup
from sparta_tf.optim.weight_average import AveragedWeights, WeightAverage

__all__ = ["AveragedWeights", "MaskedOptimizer", "WeightAverage", "cosine_with_warmup"]
