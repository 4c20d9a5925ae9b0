"""One white-box audit run through ``DPModel.fit``: :func:`audit_white_box`, or its parts
(:func:`plant_gradient_canaries` before ``fit``, :func:`white_box_report` after) for a caller that runs
``fit`` itself (``sparta-audit --white-box``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.audit.gradient_canaries import CanaryObservations, GradientCanaries, head_kernel
from sparta_tf.audit.power import simulated_bound
from sparta_tf.audit.white_box import WhiteBoxAudit, per_score_confidence, white_box_audit
from sparta_tf.privacy.banded import BandedFactorization

DEFAULT_CANARIES = 1000


def canary_values(canaries: GradientCanaries) -> np.ndarray:
    """The canary coordinates' current values."""
    return np.reshape(canaries.variable.numpy(), [-1])[canaries.coordinates].astype(np.float64)


@dataclasses.dataclass
class PlantedCanaries:
    """What :func:`plant_gradient_canaries` attached: the canaries, their coordinates' values before
    training and the callback that records every step's observations."""

    canaries: GradientCanaries
    initial: np.ndarray
    recorder: CanaryObservations


def trainable_variable(model: tf.keras.Model, name: str) -> tf.Variable:
    """The trainable variable of ``model`` named ``name`` (Keras 2's ``name`` with or without ``:0``, or
    Keras 3's ``path``), or a ValueError listing a few names."""
    for variable in model.trainable_variables:
        if name in (variable_key(variable), variable_key(variable).removesuffix(":0")):
            return variable
    names = [variable_key(v) for v in model.trainable_variables]
    raise ValueError(f"no trainable variable named {name!r}; the model's include {names[-4:]}")


def plant_gradient_canaries(dp, count: int | None = None, seed: int = 0,
                            variable: tf.Variable | None = None) -> PlantedCanaries:
    """Attaches ``count`` gradient canaries (default: 1000, or the variable's size if smaller) on ``variable``
    (default: the head's kernel) to ``dp``, drawn from ``seed``'s ``canaries`` stream; pass ``.recorder``
    to ``fit``'s callbacks."""
    if dp.ledger is None:
        raise ValueError("the DP model has no ledger, so there is no claim to audit: give it delta (make_private does)")
    variable = variable if variable is not None else head_kernel(dp.model)
    count = count if count is not None else min(DEFAULT_CANARIES, int(np.prod(variable.shape)))
    canaries = GradientCanaries(variable, count, seed, dp.clip_norm)
    dp.attach_canaries(canaries)
    return PlantedCanaries(canaries, canary_values(canaries), CanaryObservations(canaries))


def white_box_report(dp, planted: PlantedCanaries, confidence: float = 0.95) -> WhiteBoxAudit:
    """The bounds and checks of a finished ``fit`` against ``dp``'s ledger (:mod:`sparta_tf.audit.white_box`)."""
    mechanism = dp.mechanism
    factor = None
    if mechanism.bands > 1:  # the claimed factorization (the analysis's), not the one the noise used
        claimed = BandedFactorization(mechanism.bands, dp._masked_optimizer.workload_momentum).coefficients
        factor = whitening_factor(claimed, planted.recorder.steps)
    audit = white_box_audit(planted.recorder.array, planted.canaries.included, planted.initial,
                            canary_values(planted.canaries), claimed_epsilon=dp.ledger.epsilon(),
                            delta=dp.ledger.delta, sample_rate=mechanism.step_sample_rate,
                            noise_std=mechanism.noise_std, clip_norm=mechanism.clip_norm, factor=factor,
                            confidence=confidence)
    if factor is not None or audit.observed_steps == 0:  # the yardstick simulates independent noise
        return audit
    expected = simulated_bound(mechanism.noise_std / mechanism.clip_norm, mechanism.step_sample_rate,
                               audit.observed_steps, audit.canaries, audit.delta,
                               confidence=per_score_confidence(confidence))
    return dataclasses.replace(audit, expected=expected)


def audit_white_box(dp, x, y, *, canaries: int | None = None, seed: int = 0, variable: tf.Variable | None = None,
                    confidence: float = 0.95, callbacks=None, **fit_kwargs) -> WhiteBoxAudit:
    """Trains ``dp`` (a compiled :class:`~sparta_tf.DPModel`, e.g. from ``make_private``, whose ledger holds
    the claim) on ``x, y`` with gradient canaries (:func:`plant_gradient_canaries`) and returns the white-box
    bounds and mechanism checks against the ledger (:func:`white_box_report`)."""
    planted = plant_gradient_canaries(dp, canaries, seed, variable)
    dp.fit(x, y, callbacks=[planted.recorder, *(callbacks or [])], **fit_kwargs)
    return white_box_report(dp, planted, confidence)


def whitening_factor(coefficients: np.ndarray, steps: list[int]) -> np.ndarray:
    """BandMF's ``C`` over the observed global ``steps``: ``C[i, j] = c_{s_i - s_j}`` for lags in the band,
    so that ``C w`` is the i.i.d. draws ``z`` of the claimed factorization."""
    steps = np.asarray(steps, np.int64)
    lag = steps[:, None] - steps[None, :]
    padded = np.append(np.asarray(coefficients, np.float64), 0.0)
    in_band = (lag >= 0) & (lag < len(coefficients))
    return np.where(in_band, padded[np.clip(lag, 0, len(coefficients))], 0.0)
