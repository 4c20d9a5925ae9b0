"""Canary scores from per-example losses of the model before and after training.

For canary ``(x_i, y_i)`` with logits ``f(x_i)``::

    loss_i(model) = -log softmax(f(x_i))[y_i]
    "loss":      score_i = -loss_i(end)                     (default)
    "loss_drop": score_i = loss_i(start) - loss_i(end)

Higher scores mean "more likely trained on". The start model is the one the
first DP step sees. Subtracting its loss removes what the model knew about a
canary before training, but in fine-tuning the head is fresh (random), so
the start loss is mostly the random head's noise: on digits with ResNet-8-GN
the plain loss separated included from left-out canaries better (AUC 0.89
vs 0.82 with the mechanism broken on purpose; 0.58 vs 0.55 for the
quickstart at epsilon 4), hence the default. Both are black-box scores: two
sets of predictions, no gradients.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["SCORES", "LossRecorder", "canary_scores", "per_example_loss"]

SCORES = ("loss", "loss_drop")

_LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def per_example_loss(model: tf.keras.Model, x: np.ndarray, y: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """``loss_i = -log softmax(model(x_i))[y_i]`` in inference mode, as float64 ``[len(x)]``."""
    losses = []
    for start in range(0, len(x), batch_size):
        logits = model(x[start:start + batch_size], training=False)
        losses.append(_LOSS(y[start:start + batch_size], logits).numpy())
    return np.concatenate(losses).astype(np.float64) if losses else np.zeros(0)


def canary_scores(loss_start: np.ndarray, loss_end: np.ndarray, score: str = "loss") -> np.ndarray:
    """The canary scores ``score`` (one of :data:`SCORES`, see the module docstring)."""
    if score == "loss":
        return -np.asarray(loss_end, np.float64)
    if score == "loss_drop":
        return np.asarray(loss_start, np.float64) - np.asarray(loss_end, np.float64)
    raise ValueError(f"score {score!r} is unknown; use one of {', '.join(SCORES)}")


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
