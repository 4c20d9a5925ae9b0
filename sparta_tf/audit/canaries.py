"""Audit canaries: examples each put into the private training set with probability 1/2.

``plant_canaries`` makes ``m`` canaries from a :class:`~sparta_tf.data.Dataset`
and returns the data set to train on. The coin flips ``S_i ~ Bernoulli(1/2)``
(i.i.d.), the choice of canaries and their labels all come from the
``canaries`` stream of ``seed`` (:mod:`sparta_tf.random_streams`): a stream of
its own, separate from the noise, sampling and data-split streams and from the
white-box audit's ``gradient_canaries``, so nothing else in the run (the
training mechanism, the gradient canaries of the same seed) depends on the
coin flips except through the data set.

Kinds (all keep the input shape and value range of ``x_train``):

* ``mislabelled`` (default): ``m`` training examples, each relabelled with a
  class other than its own, chosen uniformly. Wrong labels make a canary's
  gradient large and unlike the rest of the data: what DP-SGD's clipping and
  noise have to hide.
* ``clean``: ``m`` training examples with their true labels (the usual
  membership-inference setting; the weakest canaries).
* ``noise``: ``m`` new images, pixels uniform over ``x_train``'s range, with
  uniform random labels (out-of-distribution; no real example is used).

For ``mislabelled`` and ``clean`` the ``m`` examples are first taken out of
the training set; the ones with ``S_i = 1`` go back in (as canaries), the
others are not trained on at all. The training set therefore has
``n - m + sum_i S_i`` examples (``n + sum_i S_i`` for ``noise``), and the
run's accounting uses that size.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparta_tf import random_streams
from sparta_tf.data.dataset import Dataset

__all__ = ["CANARY_KINDS", "Canaries", "canary_rng", "plant_canaries"]

CANARY_KINDS = ("mislabelled", "clean", "noise")
CANARY_STREAM = "canaries"


def canary_rng(seed: int) -> np.random.Generator:
    """The canary stream under ``seed``."""
    return random_streams.numpy_rng(seed, CANARY_STREAM)


@dataclasses.dataclass(frozen=True)
class Canaries:
    """``m`` canaries: inputs ``x``, the labels they are trained with ``y``, coin flips ``included``.

    ``train_rows`` are the positions of the included canaries in the planted
    training set (the other rows are real examples).
    """

    x: np.ndarray
    y: np.ndarray
    included: np.ndarray
    kind: str
    seed: int
    train_rows: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


def _check(dataset: Dataset, count: int, kind: str) -> None:
    if kind not in CANARY_KINDS:
        raise ValueError(f"canary kind {kind!r} is unknown; use one of {', '.join(CANARY_KINDS)}")
    if count < 2:
        raise ValueError(f"canaries={count} must be >= 2 (an audit needs members and non-members)")
    if kind == "mislabelled" and dataset.num_classes < 2:
        raise ValueError("mislabelled canaries need at least 2 classes")
    if kind != "noise" and count > len(dataset.y_train) // 2:
        raise ValueError(f"{count} {kind} canaries would take more than half of the {len(dataset.y_train)} "
                         f"training examples; use at most {len(dataset.y_train) // 2} canaries "
                         "(or noise canaries, which take none)")


def _wrong_labels(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """A label ``!= labels[i]`` for every ``i``, uniform over the other classes."""
    shift = rng.integers(1, num_classes, size=len(labels))
    return (labels + shift) % num_classes


def _draw(dataset: Dataset, count: int, kind: str, rng: np.random.Generator):
    """``(canary x, canary y, indices of training examples used)`` for ``kind``."""
    if kind == "noise":
        low, high = float(dataset.x_train.min()), float(dataset.x_train.max())
        x = rng.uniform(low, high, size=(count, *dataset.x_train.shape[1:])).astype(dataset.x_train.dtype)
        y = rng.integers(0, dataset.num_classes, size=count).astype(dataset.y_train.dtype)
        return x, y, np.zeros(0, np.int64)
    taken = np.sort(rng.choice(len(dataset.y_train), size=count, replace=False))
    y = dataset.y_train[taken]
    if kind == "mislabelled":
        y = _wrong_labels(y, dataset.num_classes, rng).astype(dataset.y_train.dtype)
    return dataset.x_train[taken], y, taken


def plant_canaries(dataset: Dataset, count: int, kind: str = "mislabelled", seed: int = 0) -> tuple[Dataset, Canaries]:
    """``(training data set with the included canaries, the canaries)``; see the module docstring.

    The returned data set is ``dataset`` with ``x_train``/``y_train``
    replaced (real examples kept + included canaries, in an order shuffled by
    the canary stream); validation and test splits are unchanged.
    """
    _check(dataset, count, kind)
    rng = canary_rng(seed)
    x, y, taken = _draw(dataset, count, kind, rng)
    included = rng.random(count) < 0.5
    kept = np.setdiff1d(np.arange(len(dataset.y_train)), taken)
    x_train = np.concatenate([dataset.x_train[kept], x[included]])
    y_train = np.concatenate([dataset.y_train[kept], y[included]])
    order = rng.permutation(len(y_train))
    planted = dataclasses.replace(dataset, x_train=x_train[order], y_train=y_train[order])
    rows = np.flatnonzero(order >= len(kept))  # where the included canaries landed
    return planted, Canaries(x=x, y=y, included=included, kind=kind, seed=int(seed), train_rows=rows)
