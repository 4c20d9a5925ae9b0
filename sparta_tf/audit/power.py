"""The power of the white-box audit: the bound an exact, honest mechanism gives, by simulation.

A white-box canary's observations are, under the claimed DP-SGD mechanism (independent noise,
:mod:`sparta_tf.audit.white_box`)::

    x_t = C B_t + e_t,    B_t ~ Bernoulli(q) if the canary is included (else 0),  e_t ~ N(0, sigma^2 C^2)

over the ``T`` steps that observe it. :func:`simulated_bound` draws exactly that for ``m`` canaries
(each included with probability 1/2), scores them with the step log-likelihood ratio
(:func:`~sparta_tf.audit.white_box.step_scores`, the most powerful test of one canary) and returns the
one-run bound (:func:`~sparta_tf.audit.one_run.audit_scores`): what the audit of a run whose mechanism
is exactly its claim shows, with no training in the way. It is the yardstick of a measured bound:

* a measured bound near it: the audit sees everything the bound can use (nothing is lost to the
  model, the optimizer or the data);
* the bound it gives at ``(sigma / 2, q)`` or ``(sigma, 2 q)``: whether a mechanism broken by a factor
  of two could push the bound over the claim at all with ``m`` canaries.

``C`` cancels (the score is scale-free in ``x / C``), so it is set to 1. Independent noise only: for
BandMF's correlated noise the whitened observations (``z = C_band x``) are the same draws, and the
bound of the claimed mechanism is the same.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparta_tf import random_streams
from sparta_tf.audit.one_run import audit_scores
from sparta_tf.audit.white_box import step_scores

STREAM = "audit_simulation"
_CHUNK = 2_000_000  # observations drawn at a time (memory: 16 MB of float64)


@dataclasses.dataclass(frozen=True)
class SimulatedBound:
    """The bounds of ``trials`` simulated audits: their mean, lowest and highest."""

    mean: float
    low: float
    high: float
    trials: int


def simulated_scores(rng: np.random.Generator, included: np.ndarray, noise_multiplier: float, sample_rate: float,
                     steps: int) -> np.ndarray:
    """The step scores of ``len(included)`` canaries observed for ``steps`` steps of the mechanism."""
    scores = np.empty(len(included))
    per_chunk = max(1, _CHUNK // steps)
    for start in range(0, len(included), per_chunk):
        part = included[start:start + per_chunk]
        sampled = (rng.random((steps, len(part))) < sample_rate) & part
        observations = sampled + rng.normal(0.0, noise_multiplier, (steps, len(part)))
        scores[start:start + per_chunk] = step_scores(observations, sample_rate, noise_multiplier, 1.0)
    return scores


TRIALS = 20
"""Simulated audits per yardstick: enough that their range shows how far one run's bound may fall."""


def simulated_bound(noise_multiplier: float, sample_rate: float, steps: int, canaries: int, delta: float, *,
                    trials: int = TRIALS, seed: int = 0, confidence: float = 0.95) -> SimulatedBound:
    """The one-run bound of ``trials`` simulated white-box audits of the exact mechanism (module doc).

    Args:
      noise_multiplier: ``sigma`` of the mechanism simulated (the claim's, or a broken one's).
      sample_rate: ``q``, each step's probability of sampling an included canary.
      steps: ``T``, the steps that observe the canaries.
      canaries: ``m``.
      delta, confidence: as for :func:`~sparta_tf.audit.one_run.audit_scores`.
      trials, seed: simulated audits, and the seed of their draws (a public one: nothing here is private).
    """
    if noise_multiplier <= 0 or not 0 < sample_rate <= 1 or steps < 1 or canaries < 2 or trials < 1:
        raise ValueError(f"need noise_multiplier > 0, 0 < sample_rate <= 1, steps >= 1, canaries >= 2 and trials "
                         f">= 1; got {noise_multiplier}, {sample_rate}, {steps}, {canaries}, {trials}")
    rng = random_streams.numpy_rng(seed, STREAM)
    bounds = []
    for _ in range(trials):
        included = rng.random(canaries) < 0.5
        scores = simulated_scores(rng, included, noise_multiplier, sample_rate, steps)
        bounds.append(audit_scores(scores, included, delta, confidence).epsilon_lower_bound)
    return SimulatedBound(float(np.mean(bounds)), float(np.min(bounds)), float(np.max(bounds)), trials)
