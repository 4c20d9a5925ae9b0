"""Named random streams: every random choice of a run, derived from one seed in one place.

A run has one 63-bit seed ``s`` (secret: see below). Each mechanism or
random choice draws from its own *stream*, named in :data:`STREAMS`, whose
domain constant ``d`` separates it from every other stream::

    key(name, t) = stateless_fold_in([s, d_name], t, alg="philox")   # TensorFlow, per step t
    rng(name)    = numpy.random.Generator(Philox(key=[s, d_name]))      # NumPy, one-shot choices

Two streams never share a key because their domain constants differ (a
test checks they are distinct), so e.g. DP-SNIP's noise and the noise of
DP-SGD step 0 are independent draws even under the same seed; two steps of
one stream never share a key because the step is folded in.

Which streams are secret. The noise of a Gaussian mechanism and the
membership of Poisson samples must stay unknown to an adversary: whoever
knows ``s`` can recompute (and so remove) the noise or learn which examples
were in which batch. Keep the seed with the private training checkpoints,
never in exported models, logs or reports. The data-independent streams
(random masks, random pre-pruning, gradient dropping, canary choice) need
no secrecy but are derived the same way so that one seed reproduces a run.

When no seed is given, a fresh one comes from the OS's cryptographic
source (:func:`new_seed`).
"""

from __future__ import annotations

import numbers
import secrets
from typing import Any

import numpy as np
import tensorflow as tf

#: Stream name -> domain constant (distinct 32-bit values; the historical
#: constants of the sampling and noise streams are kept, so seeded runs
#: reproduce their earlier batches and noise).
STREAMS: dict[str, int] = {
    "poisson_sampling": 0x706F6973,  # "pois": Poisson batch membership per DP step (secret)
    "shuffle": 0x73687566,  # "shuf": fixed-size shuffled batches per epoch (secret)
    "dp_sgd_noise": 0x5EED0015,  # Gaussian noise of every DP-SGD / selection step (secret)
    "dp_snip_noise": 0x534E4950,  # "SNIP": DP-SNIP's one Gaussian release (secret)
    "frost_sampling": 0x46525350,  # "FRSP": DP-FROST's Poisson samples X_t (secret)
    "frost_noise": 0x46524E5A,  # "FRNZ": DP-FROST's noisy partition magnitudes (secret)
    "random_mask": 0x524D534B,  # "RMSK": the random baseline's rows / entries (public)
    "random_pruning": 0x5250524E,  # "RPRN": DP-SSGD's random pre-pruning (public)
    "gradient_dropping": 0x5EEDD809,  # DP-SSGD's per-step coordinate dropping (public)
    "canaries": 0x43414E41,  # "CANA": which audit canaries join the training set (public)
}

SECRET_STREAMS = ("poisson_sampling", "shuffle", "dp_sgd_noise", "dp_snip_noise", "frost_sampling", "frost_noise")

MAX_SEED = 2**63  # seeds live in [0, 2**63) so that they fit an int64


def new_seed() -> int:
    """A fresh secret 63-bit seed from the OS's cryptographic source."""
    return secrets.randbits(63)


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


def domain(name: str) -> int:
    """The domain constant of stream ``name`` (a ValueError for an unknown name)."""
    if name not in STREAMS:
        raise ValueError(f"unknown random stream {name!r}; known streams: {sorted(STREAMS)}")
    return STREAMS[name]


def step_key(seed: int | tf.Tensor, name: str, step: int | tf.Tensor) -> tf.Tensor:
    """The Philox key (int64 ``[2]``) of stream ``name`` at step ``step``; works in graphs."""
    base = tf.stack([tf.cast(seed, tf.int64), tf.constant(domain(name), tf.int64)])
    return tf.random.experimental.stateless_fold_in(base, tf.cast(step, tf.int64), alg="philox")


def numpy_rng(seed: int, name: str) -> np.random.Generator:
    """A NumPy generator for stream ``name`` (one-shot choices: masks, pruning, canaries)."""
    return np.random.Generator(np.random.Philox(key=[check_seed(seed), domain(name)]))
