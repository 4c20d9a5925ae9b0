"""Checking an augmentation on *public* data before spending ε on views of the private data.

Augmentation multiplicity (:mod:`sparta_tf.dp_step.views`) helps only when the views keep the
label: the averaged gradient ``(1/K) sum_k grad L(A(x_i; xi_k), y_i)`` then points where the
example's does, with less variance. A view that changes what the example shows (a shift that
moves an 8x8 digit's strokes off its grid, a flip of a digit or of text) pulls the model towards
wrong labels, and DP-SGD cannot tell. A cheap proxy that needs no private data and no ε: the
accuracy of a model trained on public data (e.g. the pre-trained model about to be fine-tuned)
on the public examples and on their views::

    clean = acc(f(x), y)            views = (1/K) sum_k acc(f(A(x; xi_k)), y)

A view accuracy well below the clean one says the views are not label-preserving for this model
(or not yet: a model trained with the augmentation may take it better); one close to it says
they are safe to try. It is a screen, not a prediction of the private run's accuracy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from sparta_tf.data.view_augmentation import view_augmentation


class AugmentationCheck(NamedTuple):
    """A model's accuracy on public examples (``clean``) and on ``views`` views of each (``views_accuracy``)."""

    clean: float
    views_accuracy: float
    views: int

    @property
    def drop(self) -> float:
        """``clean - views_accuracy`` (in accuracy, 0-1)."""
        return self.clean - self.views_accuracy

    def __str__(self) -> str:
        return (f"accuracy {self.clean:.4f} on the examples, {self.views_accuracy:.4f} on {self.views} views of each "
                f"({-self.drop:+.4f})")


def check_augmentation(model: tf.keras.Model, x, y, augmentation=None, views: int = 4, seed: int = 0,
                       batch_size: int = 256) -> AugmentationCheck:
    """The accuracy of ``model`` on *public* examples ``x, y`` and on ``views`` augmented views of
    each (see the module doc), with ``augmentation`` as ``make_private(augmentation=...)`` takes it
    (None: the default flip + pad-and-crop). ``y``: integer labels ``[N]`` or one-hot ``[N, C]``;
    ``model`` returns class scores. Never pass private data: nothing here is private."""
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise ValueError(f"views={views!r} must be an integer >= 1 (views of each example to score)")
    augment = view_augmentation(augmentation)
    augment.check(x)
    labels = np.asarray(y)
    labels = labels.argmax(axis=-1) if labels.ndim > 1 else labels.reshape(-1)
    clean = _accuracy(model, tf.convert_to_tensor(x), labels, batch_size)
    scores = [_accuracy(model, augment(tf.convert_to_tensor(x), tf.constant([seed, k], tf.int64)), labels, batch_size)
              for k in range(views)]  # public data: plain keys, no run stream
    return AugmentationCheck(clean, float(np.mean(scores)), views)


def _accuracy(model: tf.keras.Model, x, labels: np.ndarray, batch_size: int) -> float:
    scores = model.predict(x, batch_size=batch_size, verbose=0)
    return float(np.mean(np.argmax(scores, axis=-1) == labels))
