"""Named random streams: every random choice of a run, derived from its seeds in one place.

A run has a 63-bit seed ``s`` (secret; its public streams use a seed ``p``
of their own: see below). Each mechanism or
random choice draws from its own *stream*, registered in :data:`STREAMS`
with a domain constant ``d`` that separates it from every other stream::

    key(name, t) = stateless_fold_in([s, d_name], t, alg=TF_ALGORITHM)   # TensorFlow, per step t
    rng(name)    = numpy.random.Generator(Philox(key=[s, d_name]))      # NumPy, one-shot choices

(the streams of the data splits and the canaries use NumPy's default
generator seeded with ``[s, d_name]`` instead, as before they were
registered here, so that a seeded data set or audit is the one earlier
versions drew). No module draws random numbers any other way: the data
splits, the synthetic data, the augmentation layers and the audit canaries
take their generators from here as the sampling and the noise do (a test
checks that no other module builds a generator or defines a domain).

Two streams never share a key because their domain constants differ (a
test checks they are distinct), so e.g. DP-SNIP's noise and the noise of
DP-SGD step 0 are independent draws even under the same seed; two steps of
one stream never share a key because the step is folded in.

Which streams are secret. The noise of a Gaussian mechanism and the
membership of Poisson samples must stay unknown to an adversary: whoever
knows ``s`` can recompute (and so remove) the noise or learn which examples
were in which batch. Keep the seed with the private training checkpoints,
never in exported models, logs or reports. The data-independent streams
(random masks, random pre-pruning, gradient dropping, data splits,
augmentation, canaries) need no secrecy, and their outputs can be public: a
random mask can be read off the released model (its frozen rows equal the
pre-trained ones). Such an output is a test of a guessed seed, so a run
keeps two seeds (:func:`public_seed_of`):

* the *secret* seed ``s`` of the secret streams, and
* the *public* seed ``p`` of the public streams (:attr:`Stream.secret` False).

A run given a seed uses it for both (one number reproduces the run; such a
seed is only as secret as the config that holds it). A run without one
draws ``s`` and ``p`` independently from the OS's cryptographic source, so
that nothing readable off a release is a function of ``s``: trying every
``p`` that reproduces a random mask tells nothing about the noise.

When no seed is given, fresh ones come from the OS's cryptographic
source (:func:`new_seed`). ``sparta-train`` then uses seed 0 for the data
streams (splits, synthetic data, augmentation), so that runs of one config
see one data set. Two options override the public seed for one public
choice each, explicitly: the ``random`` method's ``seed`` (its mask) and
``sparta-audit --canary-seed`` (which examples become canaries).
"""

from __future__ import annotations

import dataclasses
import numbers
import secrets
from typing import Any

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Stream:
    """One registered stream: its ``domain`` constant, whether it must stay ``secret``, NumPy's
    ``generator`` for it (``"philox"``, or ``"pcg64"`` for the streams kept as earlier versions drew
    them), and what draws from it."""

    domain: int
    secret: bool
    purpose: str
    generator: str = "philox"


#: Stream name -> :class:`Stream` (distinct 32-bit domains; the historical constants are kept, so seeded
#: runs reproduce their earlier batches, noise, data splits and canaries).
STREAMS: dict[str, Stream] = {
    # -- secret: sampling and the noise of every mechanism
    "poisson_sampling": Stream(0x706F6973, True, "Poisson batch membership per DP step"),  # "pois"
    "shuffle": Stream(0x73687566, True, "fixed-size shuffled batches per epoch"),  # "shuf"
    "cyclic_groups": Stream(0x4359474E, True, "each example's group under cyclic Poisson sampling (BandMF)"),  # "CYGN"
    "user_sampling": Stream(0x55535253, True, "Poisson batch membership of users per DP step (user level)"),  # "USRS"
    "user_examples": Stream(0x55535258, True, "which of a sampled user's examples a DP step takes (user level)"),  # "USRX"
    "dp_sgd_noise": Stream(0x5EED0015, True, "Gaussian noise of every DP-SGD step"),
    "selection_noise": Stream(0x53454C4E, True, "Gaussian noise of the selection epoch's released scores"),  # "SELN"
    "dp_snip_noise": Stream(0x534E4950, True, "DP-SNIP's one Gaussian release"),  # "SNIP"
    "frost_sampling": Stream(0x46525350, True, "DP-FROST's Poisson samples X_t"),  # "FRSP"
    "frost_noise": Stream(0x46524E5A, True, "DP-FROST's noisy partition magnitudes"),  # "FRNZ"
    "frost_users": Stream(0x46525553, True, "DP-FROST's Poisson samples of users (user level)"),  # "FRUS"
    "frost_user_examples": Stream(0x46525558, True, "which of a user's examples a DP-FROST round takes (user level)"),  # "FRUX"
    "dp_snip_users": Stream(0x534E5553, True, "DP-SNIP's users (all of them at rate 1; user level)"),  # "SNUS"
    "dp_snip_user_examples": Stream(0x534E5558, True, "which of a user's examples DP-SNIP takes (user level)"),  # "SNUX"
    "tuning_count": Stream(0x54554E4B, True, "the number of candidate runs of a private tuning"),  # "TUNK"
    "tuning_candidates": Stream(0x54554E48, True, "each tuning candidate's hyperparameters"),  # "TUNH"
    "tuning_runs": Stream(0x54554E52, True, "each tuning candidate's run seed"),  # "TUNR"
    "tuning_score_noise": Stream(0x54554E53, True, "the Gaussian noise of each candidate's validation score"),  # "TUNS"
    # -- public: data-independent choices
    "random_mask": Stream(0x524D534B, False, "the random method's rows / entries"),  # "RMSK"
    "random_pruning": Stream(0x5250524E, False, "DP-SSGD's random pre-pruning"),  # "RPRN"
    "gradient_dropping": Stream(0x5EEDD809, False, "DP-SSGD's per-step coordinate dropping"),
    "augmentation": Stream(0x4155474D, False, "the seeds of the augmentation layers (flip, shift)"),  # "AUGM"
    "augmult": Stream(0x41554D54, False, "the augmented views of augmentation multiplicity per DP step"),  # "AUMT"
    "synthetic_data": Stream(0x5EED0001, False, "the synthetic data source's patterns and labels", "pcg64"),
    "test_split": Stream(0x5EED0002, False, "the test split of a source without one", "pcg64"),
    "limit_train": Stream(0x5EED0003, False, "the examples data.limit_train keeps", "pcg64"),
    "limit_test": Stream(0x5EED0004, False, "the examples data.limit_test keeps", "pcg64"),
    "val_split": Stream(0x5EED0005, False, "the validation split", "pcg64"),
    "split_key": Stream(0x53504C4B, False, "the stable splits' key derived from a public data seed"),  # "SPLK"
    "canaries": Stream(0x00CA4A21, False, "which black-box (data) audit canaries, their labels and coin flips",
                       "pcg64"),
    "gradient_canaries": Stream(0x4743414E, False, "the white-box canaries' coordinates and coin flips"),  # "GCAN"
    "canary_seed": Stream(0x43534544, False, "sparta-audit's canary seed drawn from a run's public seed"),  # "CSED"
    "audit_simulation": Stream(0x41534D4C, False, "the white-box audit's simulated exact mechanism (its yardstick)",
                               "pcg64"),  # "ASML"
}

SECRET_STREAMS = tuple(name for name, stream in STREAMS.items() if stream.secret)

MAX_SEED = 2**63  # seeds live in [0, 2**63) so that they fit an int64


def new_seed() -> int:
    """A fresh secret 63-bit seed from the OS's cryptographic source."""
    return secrets.randbits(63)


def public_seed_of(public_seed: Any, seed: Any) -> int | None:
    """The public seed ``p`` of a run whose seed argument is ``seed``: ``public_seed`` when given, else
    ``seed`` (a run given one seed reproduces from it), else None: the caller draws a fresh ``p``
    independently of the secret seed (:func:`new_seed`, or the chief's under multi-worker training)."""
    if public_seed is not None:
        return check_seed(public_seed)
    return None if seed is None else check_seed(seed)


def check_seed(seed: Any) -> int:
    """``seed`` as an int in ``[0, 2**63)``, or a ValueError naming the fix."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be None or an integer in [0, 2**63), got {seed!r}; "
                         "pass None to draw a secure random seed.")
    if not 0 <= int(seed) < MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63), got {seed!r}; reduce it, e.g. seed % 2**63.")
    return int(seed)


def resolve_seed(seed: Any) -> int:
    """A validated ``seed``, or a fresh secret one when ``seed`` is None."""
    return new_seed() if seed is None else check_seed(seed)


def stream(name: str) -> Stream:
    """The registered stream ``name`` (a ValueError naming the known ones for an unknown name)."""
    if name not in STREAMS:
        raise ValueError(f"unknown random stream {name!r}; known streams: {sorted(STREAMS)}")
    return STREAMS[name]


def domain(name: str) -> int:
    """The domain constant of stream ``name`` (a ValueError for an unknown name)."""
    return stream(name).domain


TF_ALGORITHM = "auto_select"
"""The ``alg`` of every TensorFlow stateless random op here: Philox on CPU and GPU, the same values as
``alg="philox"`` there (a test checks it), with the key scrambled inside the op. ``alg="philox"``
scrambles the seed with Python-side ops, which made a draw of MobileNetV2-sized noise (2.2M
Gaussians, 9 MiB) grow the process by ~100 MiB on 2 CPU cores, against ~20 MiB with ``auto_select``
(TF 2.15 and 2.21, measured). On TPU ``auto_select`` is ThreeFry."""


def step_key(seed: int | tf.Tensor, name: str, step: int | tf.Tensor) -> tf.Tensor:
    """The Philox key (int64 ``[2]``) of stream ``name`` at step ``step``; works in graphs."""
    base = tf.stack([tf.cast(seed, tf.int64), tf.constant(domain(name), tf.int64)])
    return tf.random.experimental.stateless_fold_in(base, tf.cast(step, tf.int64), alg=TF_ALGORITHM)


def numpy_rng(seed: int, name: str) -> np.random.Generator:
    """A NumPy generator for stream ``name`` (one-shot choices: masks, pruning, data splits, canaries)."""
    seed, registered = check_seed(seed), stream(name)
    if registered.generator == "pcg64":
        return np.random.default_rng([seed, registered.domain])
    return np.random.Generator(np.random.Philox(key=[seed, registered.domain]))


def int_seeds(seed: int, name: str, count: int) -> list[int]:
    """``count`` seeds in ``[0, 2**31)`` for APIs that take an integer seed (Keras' random layers), drawn
    from stream ``name``: distinct streams and distinct positions give independent seeds."""
    return [int(v) for v in numpy_rng(seed, name).integers(0, 2**31, size=count)]
