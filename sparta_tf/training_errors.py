"""Errors that end a training run because its model would be unusable."""


class NonFiniteTrainingError(RuntimeError):
    """Training produced a non-finite loss or weight, or an epoch none of whose sampled examples could
    be used; the model is unusable (raised by :class:`~sparta_tf.callbacks.NonFiniteGuard` and
    :class:`~sparta_tf.dp_step.usable_examples.EpochWithoutUsableExamples`)."""
