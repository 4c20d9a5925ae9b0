"""One white-box audit run through ``DPModel.fit`` (:func:`audit_white_box`)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from sparta_tf.audit.gradient_canaries import CanaryObservations, GradientCanaries, head_kernel
from sparta_tf.audit.white_box import WhiteBoxAudit, white_box_audit
from sparta_tf.privacy.banded import BandedFactorization


def canary_values(canaries: GradientCanaries) -> np.ndarray:
    """The canary coordinates' current values."""
    return np.reshape(canaries.variable.numpy(), [-1])[canaries.coordinates].astype(np.float64)


def audit_white_box(dp, x, y, *, canaries: int = 1000, seed: int = 0, variable: tf.Variable | None = None,
                    confidence: float = 0.95, callbacks=None, **fit_kwargs) -> WhiteBoxAudit:
    """Trains ``dp`` (a compiled :class:`~sparta_tf.DPModel`, e.g. from ``make_private``, whose ledger holds
    the claim) on ``x, y`` with ``canaries`` gradient canaries on ``variable`` (default: the head's kernel,
    :func:`~sparta_tf.audit.gradient_canaries.head_kernel`), drawn from ``seed``'s ``canaries`` stream, and
    returns the white-box bounds against the ledger's epsilon (:mod:`sparta_tf.audit.white_box`)."""
    if dp.ledger is None:
        raise ValueError("the DP model has no ledger, so there is no claim to audit: give it delta (make_private does)")
    planted = GradientCanaries(variable if variable is not None else head_kernel(dp.model), canaries, seed,
                               dp.clip_norm)
    dp.attach_canaries(planted)
    initial = canary_values(planted)
    recorder = CanaryObservations(planted)
    dp.fit(x, y, callbacks=[recorder, *(callbacks or [])], **fit_kwargs)
    mechanism = dp.mechanism
    factor = None
    if mechanism.bands > 1:  # the claimed factorization (the analysis's), not the one the noise used
        claimed = BandedFactorization(mechanism.bands, dp._masked_optimizer.workload_momentum).coefficients
        factor = whitening_factor(claimed, recorder.steps)
    return white_box_audit(recorder.array, planted.included, initial, canary_values(planted),
                           claimed_epsilon=dp.ledger.epsilon(), delta=dp.ledger.delta,
                           sample_rate=mechanism.step_sample_rate, noise_std=mechanism.noise_std,
                           clip_norm=mechanism.clip_norm, factor=factor, confidence=confidence)


def whitening_factor(coefficients: np.ndarray, steps: list[int]) -> np.ndarray:
    """BandMF's ``C`` over the observed global ``steps``: ``C[i, j] = c_{s_i - s_j}`` for lags in the band,
    so that ``C w`` is the i.i.d. draws ``z`` of the claimed factorization."""
    steps = np.asarray(steps, np.int64)
    lag = steps[:, None] - steps[None, :]
    padded = np.append(np.asarray(coefficients, np.float64), 0.0)
    in_band = (lag >= 0) & (lag < len(coefficients))
    return np.where(in_band, padded[np.clip(lag, 0, len(coefficients))], 0.0)
