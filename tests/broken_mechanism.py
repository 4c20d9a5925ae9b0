"""TEST-ONLY sabotage of the DP mechanism, so that the audit's must-fail tests have something to catch.

``broken_mechanism(noise=False)`` makes every Gaussian noise draw of the
DP step (training and SPARTA's selection) exactly zero;
``broken_mechanism(clipping=False)`` makes every clip factor 1 (padding
still weighs 0). :func:`subtly_broken_mechanism` makes the bugs a white-box audit must catch: the DP
step's noise at a fraction of its standard deviation, the Poisson sampler at a multiple of its rate,
BandMF's factorization without its unit column norm. The ledger does not know: it keeps claiming the epsilon of
the intact mechanism, which is the bug an audit must expose. Nothing in the
library or the CLIs can reach this; it patches module attributes for the
duration of a ``with`` block and checks that every patched attribute exists
(a refactor that moves them makes the must-fail tests fail loudly instead
of testing an intact mechanism).
"""

from __future__ import annotations

import contextlib
import importlib

import tensorflow as tf

NOISE_USERS = ("sparta_tf.dp_step.noise", "sparta_tf.selection.scoring", "sparta_tf.ssgd.pruning")
CLIP_USERS = ("sparta_tf.dp_step.clipping", "sparta_tf.selection.scoring")  # ssgd clips through dp_step.clipping


def _zero_noise(shapes, stddev, seed, step, dtype=tf.float32, stream=None):
    dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)
    return [tf.zeros(shape, d) for shape, d in zip(shapes, dtypes)]


def _zero_noise_draws(shapes, stddev, seed, step, dtype=tf.float32, stream=None):
    return [lambda z=z: z for z in _zero_noise(shapes, stddev, seed, step, dtype, stream)]


def _no_clipping(squared_norms, clip_norm, valid):
    keep = tf.logical_and(valid, tf.math.is_finite(squared_norms))
    return tf.where(keep, tf.ones_like(squared_norms), tf.zeros_like(squared_norms)), keep


@contextlib.contextmanager
def broken_mechanism(noise: bool = True, clipping: bool = True):
    """Within the block, DP steps built from now on run without noise and/or without clipping."""
    patches = [(name, "gaussian_noise", _zero_noise) for name in NOISE_USERS if not noise]
    patches += [("sparta_tf.dp_step.noise", "noise_draws", _zero_noise_draws)] if not noise else []
    patches += [(name, "clip_factors", _no_clipping) for name in CLIP_USERS if not clipping]
    saved = []
    # Import every module before patching any: a module imported for the first time inside the block would
    # bind an already-patched function by `from ... import` (scoring's gaussian_noise from dp_step.noise), and
    # "restore" that patch, leaving the rest of the process with zero selection noise.
    modules = {name: importlib.import_module(name) for name, _, _ in patches}
    try:
        for name, attribute, replacement in patches:
            module = modules[name]
            if not hasattr(module, attribute):
                raise AssertionError(f"{name}.{attribute} is gone: update tests/broken_mechanism.py")
            saved.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, replacement)
        yield
    finally:
        for module, attribute, original in reversed(saved):
            setattr(module, attribute, original)


@contextlib.contextmanager
def subtly_broken_mechanism(noise_scale: float = 1.0, rate_scale: float = 1.0, unnormalised_bands: bool = False):
    """Within the block, DP steps and samplers built from now on draw noise at ``noise_scale`` times its
    standard deviation, sample at ``rate_scale`` times the rate (at most 1), and (``unnormalised_bands``)
    correlate noise with BandMF's square-root series before its scaling to unit column norm."""
    noise = importlib.import_module("sparta_tf.dp_step.noise")
    sampling = importlib.import_module("sparta_tf.privacy.sampling")
    correlated = importlib.import_module("sparta_tf.dp_step.correlated_noise")
    banded = importlib.import_module("sparta_tf.privacy.banded")
    for module, attribute in ((noise, "noise_draws"), (sampling.PoissonSampler, "participant_mask"),
                              (correlated, "BandedFactorization"), (banded, "sqrt_series")):
        if not hasattr(module, attribute):
            raise AssertionError(f"{module}.{attribute} is gone: update tests/broken_mechanism.py")
    draws, mask, factorization = noise.noise_draws, sampling.PoissonSampler.participant_mask, \
        correlated.BandedFactorization

    def scaled_draws(shapes, stddev, *args, **kwargs):
        return draws(shapes, stddev * noise_scale, *args, **kwargs)

    def faster_mask(self, step):
        rate = self.step_sample_rate
        self.step_sample_rate = min(1.0, rate * rate_scale)
        try:
            return mask(self, step)
        finally:
            self.step_sample_rate = rate

    class Unnormalised(factorization):
        def __init__(self, bands, momentum=0.0):
            super().__init__(bands, momentum)
            self.coefficients = banded.sqrt_series(bands, momentum)

    noise.noise_draws = correlated.noise_draws = scaled_draws
    sampling.PoissonSampler.participant_mask = faster_mask
    if unnormalised_bands:
        correlated.BandedFactorization = Unnormalised
    try:
        yield
    finally:
        noise.noise_draws = correlated.noise_draws = draws
        sampling.PoissonSampler.participant_mask = mask
        correlated.BandedFactorization = factorization
