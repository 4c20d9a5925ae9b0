"""Errors that end a training run because its model would be unusable."""


class NonFiniteTrainingError(RuntimeError):
    """Training produced a non-finite weight; the model is unusable (raised by
    :class:`~sparta_tf.callbacks.NonFiniteGuard`)."""
