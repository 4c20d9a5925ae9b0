"""User-level DP: the ``k`` rows of one sampled user are one unit of the DP step, clipped once.

With the user as the privacy unit (Charles et al. 2024, "Fine-Tuning Large Language Models with
User-Level Differential Privacy": user-level sampling, per-user clipping), a step's batch comes from
:class:`~sparta_tf.privacy.user_sampling.UserPoissonSampler`: ``k`` rows per sampled user ``v``,
row weights ``w_j = 1 / k_v`` on its ``k_v = min(n_v, k)`` chosen examples and ``0`` on padding. The
step treats a user's rows as one unit, as it treats the ``K`` views of augmentation multiplicity::

    g_v = sum_j w_j grad L(x_j, y_j) = (1/k_v) sum_{j chosen} grad L_j     the user's mean gradient
    c_v = min(1, C / ||g_v||)                                              clipped once, as one unit

So adding or removing one user, whatever its number of examples, changes one unit of one step's
clipped sum, by at most ``C``: the mechanism, its noise (``N(0, sigma^2 C^2 I)``), the normaliser
(``q U``) and the ledger are DP-SGD's over ``U`` users at rate ``q``.

Layout. The engines see ``k K`` rows per unit (``K``: augmentation multiplicity's views of each
row, drawn within the user), row ``(s k + j) K + v`` being view ``v`` of the ``j``-th row of unit
``s``, and they average a unit's rows (:mod:`sparta_tf.per_example.engines`). The row's loss is
therefore scaled by ``k w_j`` before it enters the backward pass, so that the unit's loss is::

    (1 / (k K)) sum_j sum_v k w_j L(v_jv, y_j) = sum_j w_j (1/K) sum_v L(v_jv, y_j)

The scale travels with the labels (``y -> (y, k w)``, :meth:`UserUnits.unit_loss` unpacks it), so
every engine, the selection scorers and the micro-batch loop take it unchanged. Padding rows and
rows with a non-finite input have their inputs zeroed; a user with a non-finite chosen row is
dropped as a whole (its unit contributes exactly zero).
"""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.per_example.engines import finite_rows, view_rows
from sparta_tf.privacy.ledger import check_unit


def check_user_level(unit: str, examples_per_user, sampling: str, bands: int) -> str:
    """``unit`` (checked by :func:`~sparta_tf.privacy.ledger.check_unit`), or a ValueError naming the fix for
    what user-level DP does not cover: ``examples_per_user`` without ``unit="user"``, sampling other than
    Poisson over users, correlated noise (``bands > 1``: its cyclic groups are of examples). ``k`` itself is
    checked by :class:`UserUnits`."""
    if check_unit(unit) == "example":
        if examples_per_user is not None:
            raise ValueError(f"examples_per_user={examples_per_user!r} needs unit='user' (user-level DP); pass "
                             "unit='user' with users= in fit, or leave examples_per_user out")
        return unit
    if sampling != "poisson":
        raise ValueError(f"unit='user' samples users with Poisson sampling, which sampling={sampling!r} is not; use "
                         "sampling='poisson'")
    if bands > 1:
        raise ValueError(f"unit='user' with bands={bands}: correlated noise's cyclic groups are of examples, and "
                         "user-level DP here covers independent noise only; use bands=1")
    return unit


def check_examples_per_user(examples_per_user) -> int:
    """``k`` as an int >= 1, or a ValueError naming the fix."""
    if isinstance(examples_per_user, bool) or not isinstance(examples_per_user, int) or examples_per_user < 1:
        raise ValueError(f"examples_per_user={examples_per_user!r} must be an integer >= 1 (the most examples of "
                         "one user in a step); use e.g. examples_per_user=8")
    return examples_per_user


class UserUnits:
    """The step's user units: ``examples_per_user = k`` rows per unit (see the module doc)."""

    def __init__(self, examples_per_user: int):
        self.examples_per_user = check_examples_per_user(examples_per_user)

    def __repr__(self) -> str:
        return f"UserUnits(examples_per_user={self.examples_per_user})"

    def group(self, x, y, weights: tf.Tensor, views=None, key=None):
        """``(rows, labels, valid, sampled)`` of a (micro-)batch of ``k P`` rows with row weights
        ``weights``: the rows' inputs (views with ``views``, drawn with ``key``; padding and
        non-finite rows zeroed), the labels packed with each row's loss scale ``k w`` (repeated over
        the views), and ``[P]`` bools: the units usable (some weight, every weighted row finite) and
        the units sampled (some weight)."""
        weights = tf.cast(weights, tf.float32)
        row_weighted = weights > 0
        labels = (y, float(self.examples_per_user) * weights)
        if views is None:
            rows, row_usable = finite_rows(x, row_weighted)
        else:
            rows, labels, row_usable = views.expand(x, labels, row_weighted, key)
        sampled = tf.reduce_any(self._per_unit(row_weighted), axis=1)
        complete = tf.reduce_all(tf.equal(self._per_unit(row_usable), self._per_unit(row_weighted)), axis=1)
        return rows, labels, tf.logical_and(sampled, complete), sampled

    @staticmethod
    def unit_loss(loss_fn):
        """The per-row loss of packed labels ``(y, scale)``: ``scale * loss_fn(y, predictions)``."""
        def scaled(labels, predictions):
            y, scale = labels
            losses = loss_fn(y, predictions)
            return losses * tf.cast(scale, losses.dtype)

        return scaled

    def metric_rows(self, labels, predictions, losses: tf.Tensor, weights: tf.Tensor, views: int):
        """``(y, predictions, losses, weights)`` per row (and view) for the metrics: the labels
        unpacked, a unit's loss (the user's mean) repeated over its rows, and each row's 0/1 weight."""
        rows_per_unit = self.examples_per_user * views
        mask = tf.cast(tf.cast(weights, tf.float32) > 0, tf.float32)
        return labels[0], predictions, view_rows(losses, rows_per_unit), view_rows(mask, views)

    def _per_unit(self, per_row: tf.Tensor) -> tf.Tensor:
        return tf.reshape(per_row, [-1, self.examples_per_user])


def user_mean_gradients(grads, row_weights: tf.Tensor, row_valid: tf.Tensor, examples_per_user: int):
    """Each user's mean gradient from the per-row gradients of ``P`` users' padded rows (``k`` rows per user,
    :meth:`~sparta_tf.privacy.user_sampling.UserPoissonSampler.padded_rows`: row weight ``1 / k_v``, 0 on
    padding): ``g_v = sum_j w_j g_j``, ``[P, ...]`` per gradient of ``grads`` (``[k P, ...]`` each), and ``[P]``
    bools, the users a mechanism may count (a weighted row, and no weighted row that is not ``row_valid``: a
    user with a non-finite example is dropped whole, as the DP step drops it). The mechanisms run before
    training (DP-SNIP, DP-FROST's rounds) clip ``g_v`` once per user, as the DP step clips a user's unit."""
    k = check_examples_per_user(examples_per_user)
    weights = tf.cast(row_weights, tf.float32)
    weighted = weights > 0
    kept = tf.logical_and(weighted, tf.cast(row_valid, tf.bool))
    usable = tf.logical_and(tf.reduce_any(tf.reshape(weighted, [-1, k]), axis=1),
                            tf.reduce_all(tf.reshape(tf.equal(kept, weighted), [-1, k]), axis=1))
    means = []
    for gradient in grads:
        gradient = tf.convert_to_tensor(gradient)
        shape = tf.concat([[-1, k], tf.shape(gradient)[1:]], axis=0)
        row_shape = tf.concat([tf.shape(weights), tf.ones([tf.rank(gradient) - 1], tf.int32)], axis=0)
        rows = tf.where(tf.reshape(kept, row_shape), gradient, tf.zeros_like(gradient))  # NaN * 0 is NaN
        means.append(tf.reduce_sum(tf.reshape(rows * tf.cast(tf.reshape(weights, row_shape), gradient.dtype),
                                              shape), axis=1))
    return means, usable
