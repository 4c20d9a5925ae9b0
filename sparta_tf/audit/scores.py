"""Canary scores: per-example losses of the model before and after training.

For canary ``(x_i, y_i)`` with logits ``f(x_i)``::

    loss_i(model) = -log softmax(f(x_i))[y_i]
    score_i       = loss_i(start) - loss_i(end)       (the loss drop)

The start model is the one the first DP step sees (pre-trained backbone and
fresh head); a canary that training saw tends to lose more loss than one it
did not. Subtracting the start loss removes what the model "knew" about the
canary before training (how hard it was to begin with). The loss drop is a
black-box score: it needs two sets of predictions, no gradients.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["LossRecorder", "per_example_loss"]

_LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def per_example_loss(model: tf.keras.Model, x: np.ndarray, y: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """``loss_i = -log softmax(model(x_i))[y_i]`` in inference mode, as float64 ``[len(x)]``."""
    losses = []
    for start in range(0, len(x), batch_size):
        logits = model(x[start:start + batch_size], training=False)
        losses.append(_LOSS(y[start:start + batch_size], logits).numpy())
    return np.concatenate(losses).astype(np.float64) if losses else np.zeros(0)


class LossRecorder(tf.keras.callbacks.Callback):
    """Records :func:`per_example_loss` of ``(x, y)`` when ``fit`` starts and when it ends.

    The losses are taken from the wrapped Keras model of a
    :class:`~sparta_tf.DPModel` (``model.model``) or from the model itself.
    ``start`` is ``None`` until ``fit`` begins, ``end`` until it returns.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray):
        super().__init__()
        self.x, self.y = x, y
        self.start: np.ndarray | None = None
        self.end: np.ndarray | None = None

    def _losses(self) -> np.ndarray:
        return per_example_loss(getattr(self.model, "model", self.model), self.x, self.y)

    def on_train_begin(self, logs=None):
        if self.start is None:  # only the first fit's start is the run's start
            self.start = self._losses()

    def on_train_end(self, logs=None):
        self.end = self._losses()

    def loss_drop(self) -> np.ndarray:
        """``start - end`` per example (higher = more likely trained on)."""
        if self.start is None or self.end is None:
            raise RuntimeError("LossRecorder.loss_drop() needs a finished fit (no start or end losses recorded)")
        return self.start - self.end
