"""Poisson sampling input pipeline for DP-SGD.

The privacy accountant (``sparta_tf.privacy``) analyses every training step as
a *Poisson-subsampled* Gaussian mechanism: at logical step ``t`` each of the
``n`` training examples joins the batch ``B_t`` independently with probability
``q`` (the *sample rate*), so the batch size ``|B_t| ~ Binomial(n, q)`` varies
from step to step. This module produces exactly such batches from in-memory
data as an infinite :class:`tf.data.Dataset`, in a form Keras and XLA can use:

* **Exact Bernoulli draw.** ``B_t = {i : u_i < q}`` with
  ``u = stateless_uniform([n], seed_t, float64)`` (Philox, :data:`~sparta_tf.random_streams.TF_ALGORITHM`). Float64
  uniforms are multiples of ``2**-52``, so ``P(i in B_t)`` equals ``q`` up to
  less than ``2**-52`` (exactly ``q`` when ``q = 1``); float32 would bias small
  rates (by up to ``2**-23 / q`` relatively).
* **Padding, never dropping.** Let ``m = |B_t|`` and ``P`` the *physical batch
  size*. The sampled indices (in increasing order) are padded to length
  ``k * P`` with ``k = max(1, ceil(m / P))``; padding rows get
  ``sample_weight = 0.0`` exactly and real rows ``1.0``, so
  ``sum(sample_weight) == m``. A sample larger than ``P`` gives ``k > 1``
  (the train step splits the element into ``k`` micro-batches of ``P`` and
  accumulates clipped gradients before adding noise once); an empty sample
  still gives one all-padding batch of ``P`` rows, because the noisy update
  must happen at every step for the accounting to hold. Padding rows repeat
  the features and label of example 0: they are in-distribution, so the model
  produces finite values on them and ``0 * loss`` stays exactly ``0`` (an
  all-zero image or token could, for some models, produce ``inf``/``nan``,
  and ``0 * nan`` is ``nan``). The train step must weight *per-example*
  gradients by ``sample_weight`` before summing, and the model must not mix
  examples (BatchNorm in training mode would; use GroupNorm/LayerNorm).
  Normalise the noisy sum by the expected batch size ``q * n``
  (:attr:`PoissonSampler.expected_batch_size`), not by ``m``.
* **Elements** are Keras triples ``(x_batch, y_batch, sample_weight)`` whose
  leading dimension is ``None`` (``k * P``, almost always ``P`` when
  ``P >= qn + 4 sqrt(qn(1-q))``, see :func:`default_physical_batch_size`).

Seed policy
-----------
A sampler has one 63-bit integer ``seed`` (drawn from :mod:`secrets` when not
given; read it back from :attr:`PoissonSampler.seed` and store it with the
checkpoint). The randomness of global step ``t`` is::

    seed_t = random_streams.step_key(seed, "poisson_sampling", t)
           = stateless_fold_in([seed, POISSON_DOMAIN], t, alg=random_streams.TF_ALGORITHM)

(:mod:`sparta_tf.random_streams`: one named stream per mechanism). Element
``t`` depends only on ``(seed, t)``, so a run resumed with ``start_step=t``
yields exactly the batches an uninterrupted run yields from step ``t`` on,
and the draw is the same on CPU and GPU. Other mechanisms that sample
(DP-FROST's selection rounds) pass their own ``stream``;
:func:`sparta_tf.privacy.shuffling.shuffled_dataset` uses the ``"shuffle"`` stream.

**Keep the seed secret.** Privacy amplification by subsampling assumes the
adversary does not know which examples were in which batch; anyone who knows
the seed and the data order knows every ``B_t``. Store the seed with the
(private) checkpoint, never in logs, released models or reports.

Cyclic Poisson sampling
-----------------------
With ``bands = b > 1`` (BandMF's correlated noise, :mod:`sparta_tf.privacy.banded`) every example gets a
group ``g_i``, uniform on ``0..b-1`` and independent of every other example's (one draw of the secret
``"cyclic_groups"`` stream; with one example more or less, the others' groups have the same distribution,
which the analysis needs), and step ``t``
samples ``B_t = {i : g_i = t mod b, u_i < b q}``. Each example then takes part only in steps of its
residue class, at least ``b`` steps apart, and per step still with probability ``q``; the rate of its
group's steps, ``q_b = b q``, comes from :func:`sparta_tf.privacy.rates.cyclic_sample_rate`. The steps of a
run that release no gradient (a selection epoch; ``plain_steps``, from the run's
:class:`~sparta_tf.privacy.layout.SamplingLayout`) sample every example at ``q`` instead.

Tensor placement: the data are converted once to tensors on the host CPU and
captured by the ``tf.data`` map function (by reference, not as graph
constants); each element is one ``gather`` of at most ``k * P`` rows.
"""

from __future__ import annotations

import math
import numbers
import weakref
from typing import Any, NamedTuple, Sequence

import tensorflow as tf

from sparta_tf import random_streams
from sparta_tf.privacy.array_inputs import (
    check_extra_participants,
    check_positive_int,
    check_sample_rate,
    check_start_step,
    examples_fingerprint,
    gather_rows,
    num_examples,
    to_host_tensors,
)
from sparta_tf.privacy.layout import SamplingLayout
from sparta_tf.privacy.rates import cyclic_sample_rate

__all__ = [
    "POISSON_DOMAIN",
    "PoissonSampler",
    "default_physical_batch_size",
    "poisson_dataset",
    "poisson_provenance",
    "Provenance",
    "steps_per_epoch",
]

POISSON_STREAM = "poisson_sampling"
#: Domain constant of the Poisson sampling stream (see :mod:`sparta_tf.random_streams`).
POISSON_DOMAIN: int = random_streams.domain(POISSON_STREAM)

class Provenance(NamedTuple):
    """What :meth:`PoissonSampler.dataset` made a dataset of: ``n`` examples at rate ``sample_rate``, in
    ``layout`` (bands and plain steps, :mod:`sparta_tf.privacy.layout`), its first element global step
    ``start_step`` (every iteration of the dataset, e.g. each ``fit`` it is given to, starts there). With
    ``bands > 1`` also what decides each example's cyclic group: the sampler's ``seed`` and ``examples``
    (:func:`~sparta_tf.privacy.array_inputs.examples_fingerprint` of ``x, y``); else None for both."""

    n: int
    sample_rate: float
    layout: SamplingLayout
    start_step: int
    seed: int | None = None
    examples: str | None = None


#: ``dataset -> Provenance`` for every dataset :meth:`PoissonSampler.dataset` returned (weak keys: it
#: does not keep them alive). Any transformation (``map``, ``take``, ``batch``) makes a new
#: dataset, which is not in here.
_POISSON_DATASETS: "weakref.WeakKeyDictionary[tf.data.Dataset, Provenance]" = weakref.WeakKeyDictionary()


def poisson_provenance(dataset: tf.data.Dataset) -> Provenance | None:
    """:class:`Provenance` when ``dataset`` is exactly what ``PoissonSampler(n, q, ...).dataset`` returned,
    else ``None`` (a dataset made any other way, or transformed after the sampler made it): the accountant's
    Poisson analysis holds only for the former, at that ``q`` and layout, its elements being the steps the
    model runs (``start_step`` its next DP step)."""
    return _POISSON_DATASETS.get(dataset)


# --------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------


def steps_per_epoch(sample_rate: float) -> int:
    """Logical steps per epoch under Poisson sampling: ``max(1, round(1 / q))``.

    An "epoch" of Poisson sampling is ``1 / q`` steps, so that each example is
    expected to be used once. Uses Python's :func:`round` (halves to even).
    """
    q = check_sample_rate(sample_rate)
    return max(1, round(1.0 / q))


def default_physical_batch_size(
    n: int, sample_rate: float, multiple_of: int = 1, num_std: float = 4.0
) -> int:
    """A physical batch size ``P`` that almost always holds a whole sample.

    With ``m ~ Binomial(n, q)``, mean ``qn`` and standard deviation
    ``s = sqrt(n q (1 - q))``::

        P = roundup(min(n, ceil(qn + num_std * s)), multiple_of)

    For ``num_std = 4`` (normal approximation) ``P(m > P) ~ 3e-5`` per step, so
    the extra micro-batch (``k = 2``) is rare; when it happens nothing is
    dropped, the step just costs one more micro-batch. ``P`` never needs to
    exceed ``n`` (``m <= n``) except for the rounding.

    Args:
      n: data set size.
      sample_rate: Poisson rate ``q`` in (0, 1].
      multiple_of: round ``P`` up to a multiple of this; with ``tf.distribute``
        pass the number of replicas so every replica gets ``P / replicas``
        rows of each micro-batch (and a multiple of 8 is friendly to GPUs).
      num_std: number of standard deviations of head-room above ``qn``.

    Returns:
      ``P >= 1``, a multiple of ``multiple_of``.
    """
    n = check_positive_int(n, "n", "pass the number of training examples")
    q = check_sample_rate(sample_rate)
    multiple_of = check_positive_int(
        multiple_of, "multiple_of", "pass e.g. strategy.num_replicas_in_sync"
    )
    if not (isinstance(num_std, numbers.Real) and num_std >= 0):
        raise ValueError(f"num_std must be a real number >= 0, got {num_std!r}; pass e.g. 4.0.")
    mean = q * n
    std = math.sqrt(n * q * (1.0 - q))
    p = max(1, min(n, math.ceil(mean + float(num_std) * std - 1e-9)))
    return -(-p // multiple_of) * multiple_of


# --------------------------------------------------------------------------
# Poisson sampling
# --------------------------------------------------------------------------


class PoissonSampler:
    """Poisson sampling of ``n`` examples at rate ``q``, padded to ``P`` rows.

    Attributes:
      n: data set size.
      sample_rate: the rate ``q``.
      physical_batch_size: ``P``; every element has ``k * P`` rows.
      seed: the 63-bit seed (see the module docstring's seed policy; secret).
      stream: the named random stream of the membership draws
        (:mod:`sparta_tf.random_streams`; ``"poisson_sampling"`` for DP-SGD).
      steps_per_epoch: ``max(1, round(1 / q))``.
      expected_batch_size: ``q * n``, the normaliser of the noisy gradient sum.
      extra: participants beyond the ``n`` examples, sampled by the same draws (positions ``n ..
        n + extra - 1``; :meth:`extra_mask`): the white-box audit's gradient canaries
        (:mod:`sparta_tf.audit.gradient_canaries`), which have no rows in the dataset.

    Example::

        sampler = PoissonSampler(len(x), 500 / len(x), seed=None)
        ds = sampler.dataset(x, y, start_step=int(dp.dp_step.numpy()))  # a new one for every fit
        dp.fit(ds, epochs=T, steps_per_epoch=sampler.steps_per_epoch)
    """

    def __init__(
        self,
        n: int,
        sample_rate: float,
        physical_batch_size: int | None = None,
        seed: int | None = None,
        stream: str = POISSON_STREAM,
        bands: int = 1,
        extra: int = 0,
        plain_steps: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.n: int = check_positive_int(n, "n", "pass the number of training examples")
        self.extra: int = check_extra_participants(extra)
        self.sample_rate: float = check_sample_rate(sample_rate)
        if physical_batch_size is None:
            physical_batch_size = default_physical_batch_size(self.n, self.sample_rate)
        self.physical_batch_size: int = check_positive_int(
            physical_batch_size,
            "physical_batch_size",
            "pass e.g. default_physical_batch_size(n, sample_rate)",
        )
        self.seed: int = random_streams.resolve_seed(seed)
        random_streams.domain(stream)  # an unknown stream name fails here, not mid-training
        self.stream: str = stream
        self.layout: SamplingLayout = SamplingLayout(bands, tuple(plain_steps))
        self.bands: int = self.layout.bands
        self.step_sample_rate: float = cyclic_sample_rate(self.sample_rate, self.bands)
        with tf.device("/CPU:0"):  # drawn once, beside the data; every step's mask reads it
            self._groups = self._draw_groups()

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.sample_rate)

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * (self.n + self.extra)

    def __repr__(self) -> str:  # never print the secret seed
        return (
            f"PoissonSampler(n={self.n}, sample_rate={self.sample_rate}, "
            f"physical_batch_size={self.physical_batch_size}, seed=<hidden>"
            + self.layout.sampler_arguments()
            + ("" if self.extra == 0 else f", extra={self.extra}") + ")"
        )

    def groups(self) -> tf.Tensor:
        """int64 [n + extra]: each participant's group ``g_i`` under cyclic Poisson sampling (all 0 with one
        band)."""
        return self._groups

    def _draw_groups(self) -> tf.Tensor:
        if self.bands == 1:
            return tf.zeros([self.participants], tf.int64)
        return tf.random.stateless_uniform([self.participants], seed=random_streams.step_key(self.seed, "cyclic_groups", 0),
                                           minval=0, maxval=self.bands, dtype=tf.int64,
                                           alg=random_streams.TF_ALGORITHM)

    @property
    def participants(self) -> int:
        """``n + extra``: everyone the draws sample."""
        return self.n + self.extra

    def participant_mask(self, step: int | tf.Tensor) -> tf.Tensor:
        """Bool [n + extra]: who is in the sample of global step ``step`` (of its group, with bands; every
        participant at ``q`` in the layout's plain steps)."""
        u = tf.random.stateless_uniform(
            [self.participants],
            seed=random_streams.step_key(self.seed, self.stream, step),
            dtype=tf.float64,
            alg=random_streams.TF_ALGORITHM,
        )
        sampled = u < tf.constant(self.step_sample_rate, tf.float64)
        if self.bands == 1:
            return sampled
        cyclic = sampled & tf.equal(self._groups, tf.math.floormod(tf.cast(step, tf.int64), self.bands))
        if not self.layout.plain:
            return cyclic
        return tf.where(self.layout.plain_mask(step), u < tf.constant(self.sample_rate, tf.float64), cyclic)

    def sample_mask(self, step: int | tf.Tensor) -> tf.Tensor:
        """Bool [n]: which examples are in the sample of global step ``step``."""
        mask = self.participant_mask(step)
        return mask if self.extra == 0 else mask[: self.n]

    def extra_mask(self, step: int | tf.Tensor) -> tf.Tensor:
        """Bool [extra]: which extra participants are in the sample of global step ``step``."""
        return self.participant_mask(step)[self.n:]

    def padded_indices(self, step: int | tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Indices and weights of step ``step``, padded to ``k * P``.

        Returns:
          ``(indices, sample_weight)``: int64 [k*P] (the sampled example ids in
          increasing order, then zeros = example 0 as padding) and float32
          [k*P] (1.0 for the ``m`` real rows, 0.0 for padding), with
          ``k = max(1, ceil(m / P))``.
        """
        p = self.physical_batch_size
        idx = tf.where(self.sample_mask(step))[:, 0]  # int64 [m], increasing
        m = tf.shape(idx, out_type=tf.int64)[0]
        k = tf.maximum(tf.constant(1, tf.int64), (m + p - 1) // p)
        length = k * p
        indices = tf.pad(idx, [[0, length - m]])  # pads with index 0
        weights = tf.sequence_mask(m, length, dtype=tf.float32)
        return indices, weights

    def dataset(self, x: Any, y: Any, start_step: int = 0) -> tf.data.Dataset:
        """Infinite dataset of ``(x_batch, y_batch, sample_weight)``, one per step.

        Element ``j`` is global step ``t = start_step + j``; see the module
        docstring for the sampling, padding and seed conventions. ``x`` and
        ``y`` are arrays/tensors or nests of them with ``n`` examples on
        axis 0.
        """
        n = num_examples(x, y)
        if n != self.n:
            raise ValueError(
                f"the sampler was built for n={self.n} examples but x/y have {n}; "
                "build the PoissonSampler with n=len(x)."
            )
        start_step = check_start_step(start_step)
        x_t, y_t = to_host_tensors(x), to_host_tensors(y)

        def element(t: tf.Tensor) -> tuple[Any, Any, tf.Tensor]:
            indices, weights = self.padded_indices(t)
            return gather_rows(x_t, indices), gather_rows(y_t, indices), weights

        ds = tf.data.Dataset.counter(start_step, dtype=tf.int64).map(element).prefetch(tf.data.AUTOTUNE)
        groups = (self.seed, examples_fingerprint(x, y)) if self.layout.bands > 1 else (None, None)
        _POISSON_DATASETS[ds] = Provenance(self.n, self.sample_rate, self.layout, start_step, *groups)
        return ds


def poisson_dataset(
    x: Any,
    y: Any,
    sample_rate: float,
    physical_batch_size: int,
    seed: int | None = None,
    start_step: int = 0,
) -> tf.data.Dataset:
    """Infinite Poisson-sampled dataset; shorthand for :class:`PoissonSampler`.

    ``PoissonSampler(len(x), sample_rate, physical_batch_size, seed)
    .dataset(x, y, start_step)``. With ``seed=None`` a secure seed is drawn and
    cannot be recovered, so the run cannot be resumed exactly: build a
    :class:`PoissonSampler` and store its ``.seed`` when you need that.
    """
    sample_rate = check_sample_rate(sample_rate)
    physical_batch_size = check_positive_int(
        physical_batch_size,
        "physical_batch_size",
        "pass e.g. default_physical_batch_size(n, sample_rate)",
    )
    n = num_examples(x, y)
    sampler = PoissonSampler(n, sample_rate, physical_batch_size, seed)
    return sampler.dataset(x, y, start_step=start_step)
