"""Poisson sampling of users: the input pipeline of user-level DP-SGD.

With the user as the privacy unit (Charles et al. 2024, "Fine-Tuning Large Language Models with
User-Level Differential Privacy": user-level sampling, per-user clipping), the ``n`` examples carry
user ids, ``U`` distinct users. At global step ``t``:

* each user joins the sample independently with probability ``q`` (``u_v < q``,
  ``u = stateless_uniform([U], step_key(seed, "user_sampling", t), float64)``, as
  :mod:`sparta_tf.privacy.sampling` draws examples);
* a sampled user ``v`` with ``n_v`` examples contributes ``k_v = min(n_v, k)`` of them
  (``k = examples_per_user``): the ``k_v`` with the smallest keys
  ``r_i = stateless_uniform([n], step_key(seed, "user_examples", t))`` among its examples, a uniform
  subset without replacement drawn afresh each step;
* the element holds ``k`` rows per sampled user, row ``s k + j`` the ``j``-th chosen example of the
  ``s``-th sampled user (in user order), with row weight ``1 / k_v`` (the DP step's unit gradient is
  the mean of the user's ``k_v`` example gradients, clipped once) and ``0`` on padding rows (a user
  with fewer than ``k`` examples, and whole padding units up to ``ceil(m / P) P`` units for ``m``
  sampled users and ``P`` units per physical batch).

So one user changes one unit of one step's sum, whose norm the DP step clips to ``C``: the mechanism,
its noise and its ledger are DP-SGD's over ``U`` users at rate ``q``. Padding rows have weight 0; a
sampled user's padding rows repeat its own first chosen example, never another user's (a padding row's
input is zeroed but its label is kept, and a label whose loss is not finite at that input would drop
the user's whole unit: that must depend on the user's own data only); whole padding units repeat
example 0, as :class:`~sparta_tf.privacy.sampling.PoissonSampler` pads.

Both streams are secret (the run's seed): whoever knows it knows every step's users and examples. A mechanism
other than the DP step that samples users (DP-FROST's rounds, DP-SNIP) names streams of its own (``stream``,
``examples_stream``), so that its samples are independent of the steps'.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from sparta_tf import random_streams
from sparta_tf.privacy import array_inputs as inputs
from sparta_tf.privacy.sampling import default_physical_batch_size, steps_per_epoch

USER_STREAM = "user_sampling"
EXAMPLES_STREAM = "user_examples"


def dense_user_ids(users: Any) -> tuple[np.ndarray, int]:
    """``(ids, U)``: each example's user as an int64 in ``0..U-1`` (users numbered in sorted order of
    their ids), or a ValueError naming the fix (an empty or non-1-D key, a missing or non-finite id)."""
    users = np.asarray(users)
    if users.ndim != 1 or users.size == 0:
        raise ValueError(f"users must be one id per example (a 1-D array), got shape {users.shape}; pass "
                         "users=array_of_ids with len(users) == len(x)")
    if users.dtype.kind == "f" and not np.all(np.isfinite(users)):
        raise ValueError(f"users holds {int(np.sum(~np.isfinite(users)))} non-finite ids; give every example "
                         "the id of its user (an int or a string)")
    if users.dtype.kind == "O" and any(u is None for u in users):
        raise ValueError("users holds None ids; give every example the id of its user (an int or a string)")
    _, dense = np.unique(users, return_inverse=True)
    return dense.astype(np.int64), int(dense.max()) + 1


DEFAULT_EXAMPLES_PER_USER = 8
"""``k`` when none is given: a constant, not read off the data. A ``k`` chosen from the users' sizes would make
the mechanism itself depend on the private data (one user more could change it for everyone), which the
guarantee does not cover; :func:`share_left_out` says what a ``k`` leaves out, for choosing one."""


def share_left_out(sizes: np.ndarray, examples_per_user: int) -> float:
    """The share of the examples a cap ``k`` leaves out of every step, from the users' sizes ``n_v``:
    ``sum_v max(n_v - k, 0) / n``."""
    sizes = np.asarray(sizes)
    return float(np.sum(np.maximum(sizes - examples_per_user, 0)) / sizes.sum())


class UserPoissonSampler:
    """Poisson sampling of users at rate ``q``, at most ``examples_per_user`` examples each (module doc).

    Attributes:
      users: the number of users ``U``; ``n``: of examples.
      sample_rate: ``q`` (per user).
      examples_per_user: ``k``.
      units_per_batch: ``P``, users per physical batch (an element has ``c k P`` rows, ``c >= 1``).
      expected_batch_size: ``q U``, the normaliser of the noisy sum (units, not rows).
      left_out: the share of the examples the cap leaves out of every step (users with more than ``k``).
      extra: participants beyond the ``U`` users, sampled by the same draws (:meth:`extra_mask`): the
        white-box audit's canary users (:mod:`sparta_tf.audit.gradient_canaries`), without rows.
    """

    def __init__(self, users: Any, sample_rate: float, examples_per_user: int,
                 units_per_batch: int | None = None, seed: int | None = None, extra: int = 0,
                 stream: str = USER_STREAM, examples_stream: str = EXAMPLES_STREAM) -> None:
        for name in (stream, examples_stream):
            random_streams.stream(name)  # a registered stream (a mechanism's own), or a ValueError
        self.stream, self.examples_stream = stream, examples_stream
        self._ids, self.users = dense_user_ids(users)
        self.extra: int = inputs.check_extra_participants(extra)
        self.n: int = len(self._ids)
        self.sample_rate: float = inputs.check_sample_rate(sample_rate)
        self.examples_per_user: int = inputs.check_positive_int(examples_per_user, "examples_per_user",
                                                         "cap each user's examples per step, e.g. 8")
        if units_per_batch is None:
            units_per_batch = default_physical_batch_size(self.users, self.sample_rate)  # in users
        self.units_per_batch: int = inputs.check_positive_int(units_per_batch, "units_per_batch",
                                                       "pass e.g. default_physical_batch_size(users, sample_rate)")
        self.seed: int = random_streams.resolve_seed(seed)
        counts = np.bincount(self._ids, minlength=self.users)
        self.left_out: float = share_left_out(counts, self.examples_per_user)
        self._counts = tf.constant(counts, tf.int64)
        self._user_of = tf.constant(self._ids, tf.int64)

    def __repr__(self) -> str:  # never print the secret seed
        return (f"UserPoissonSampler(users={self.users}, n={self.n}, sample_rate={self.sample_rate}, "
                f"examples_per_user={self.examples_per_user}, units_per_batch={self.units_per_batch}, "
                "seed=<hidden>)")

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.sample_rate)

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.users

    def participant_mask(self, step: int | tf.Tensor) -> tf.Tensor:
        """Bool ``[U + extra]``: the users and extra participants in the sample of global step ``step``."""
        u = tf.random.stateless_uniform([self.users + self.extra],
                                        seed=random_streams.step_key(self.seed, self.stream, step),
                                        dtype=tf.float64, alg=random_streams.TF_ALGORITHM)
        return u < tf.constant(self.sample_rate, tf.float64)

    def user_mask(self, step: int | tf.Tensor) -> tf.Tensor:
        """Bool ``[U]``: the users in the sample of global step ``step``."""
        mask = self.participant_mask(step)
        return mask if self.extra == 0 else mask[: self.users]

    def extra_mask(self, step: int | tf.Tensor) -> tf.Tensor:
        """Bool ``[extra]``: the extra participants (a white-box audit's canary users, without rows) in the
        sample of global step ``step``."""
        return self.participant_mask(step)[self.users:]

    def example_ranks(self, step: int | tf.Tensor) -> tf.Tensor:
        """Int64 ``[n]``: each example's rank among its user's examples in step ``step``'s random order
        (the step takes ranks ``0..k-1``)."""
        keys = tf.random.stateless_uniform([self.n], seed=random_streams.step_key(self.seed, self.examples_stream, step),
                                           dtype=tf.float64, alg=random_streams.TF_ALGORITHM)
        order = tf.argsort(tf.cast(self._user_of, tf.float64) + keys, stable=True)  # by user, then by key
        first = tf.cumsum(self._counts, exclusive=True)  # each user's first position in that order
        position = tf.math.invert_permutation(tf.cast(order, tf.int64))
        return position - tf.gather(first, self._user_of)

    def padded_rows(self, step: int | tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """``(indices, row_weights)`` of step ``step``: int64 and float32 ``[c k P]`` (module doc)."""
        k, p = self.examples_per_user, self.units_per_batch
        sampled = self.user_mask(step)
        slot_of_user = tf.cumsum(tf.cast(sampled, tf.int64)) - 1  # the sampled users' slots, in user order
        m = tf.reduce_sum(tf.cast(sampled, tf.int64))
        units = tf.maximum(tf.constant(1, tf.int64), (m + p - 1) // p) * p
        ranks = self.example_ranks(step)
        taken = tf.gather(sampled, self._user_of) & (ranks < k)
        examples = tf.where(taken)[:, 0]
        user = tf.gather(self._user_of, examples)
        rows = tf.gather(slot_of_user, user) * k + tf.gather(ranks, examples)
        length = units * k
        # padding rows: their user's first chosen example (the label of another user's example could make
        # this user's loss non-finite at a zeroed input, and so decide whether this user counts); example 0
        # in whole padding units, which no user owns
        first = tf.boolean_mask(examples, tf.equal(tf.gather(ranks, examples), 0))
        first_of_slot = tf.scatter_nd(tf.gather(slot_of_user, tf.gather(self._user_of, first))[:, None], first,
                                      [units])
        indices = tf.tensor_scatter_nd_update(tf.repeat(first_of_slot, k), rows[:, None], examples)
        share = 1.0 / tf.cast(tf.minimum(tf.gather(self._counts, user), k), tf.float32)
        weights = tf.scatter_nd(rows[:, None], share, [length])
        return indices, weights

    def row_batches(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`padded_rows` of step ``step`` as numpy ``(indices, row_weights)`` micro-batches of
        ``units_per_batch`` whole users (``k P`` rows each): for a mechanism that runs outside ``fit``."""
        indices, weights = (t.numpy() for t in self.padded_rows(step))
        rows = self.examples_per_user * self.units_per_batch
        return [(indices[start:start + rows], weights[start:start + rows]) for start in range(0, len(indices), rows)]

    def dataset(self, x: Any, y: Any, start_step: int = 0) -> tf.data.Dataset:
        """Infinite dataset of ``(x_rows, y_rows, row_weights)``, one element per global step from
        ``start_step`` (module doc); ``x`` and ``y`` hold the ``n`` examples the user ids describe."""
        n = inputs.num_examples(x, y)
        if n != self.n:
            raise ValueError(f"the sampler was built for n={self.n} examples (one user id each) but x/y have {n}; "
                             "pass users with one id per example of x")
        start_step = inputs.check_start_step(start_step)
        x_t, y_t = inputs.to_host_tensors(x), inputs.to_host_tensors(y)

        def element(t: tf.Tensor):
            indices, weights = self.padded_rows(t)
            return inputs.gather_rows(x_t, indices), inputs.gather_rows(y_t, indices), weights

        return tf.data.Dataset.counter(start_step, dtype=tf.int64).map(element).prefetch(tf.data.AUTOTUNE)
