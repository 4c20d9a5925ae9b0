"""One white-box audit run through ``DPModel.fit``: :func:`audit_white_box`, or its parts
(:func:`plant_gradient_canaries` before ``fit``, :func:`white_box_report` after) for a caller that runs
``fit`` itself (``sparta-audit --white-box``).

The claim audited is the ledger's: the scores, the checks and the yardstick use the ``sigma``, ``q`` and
bands the ledger charged for the steps that observed the canaries (:func:`charged_mechanism`), with ``C``
the canaries' own clip norm (what an included canary adds to a sampled step), never the mechanism object
the DP step reads: a step that drew less noise than its charge shows as a mismatch."""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from sparta_tf.backend import variable_key
from sparta_tf.audit.gradient_canaries import CanaryObservations, GradientCanaries, head_kernel
from sparta_tf.audit.power import simulated_bound
from sparta_tf.audit.white_box import NOT_OBSERVED, WhiteBoxAudit, white_box_audit
from sparta_tf.masks import is_mask_charge
from sparta_tf.privacy.banded import BandedFactorization
from sparta_tf.privacy.ledger import DEFAULT_KIND, INTERRUPTED

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
    (default: the head's kernel) to ``dp``, drawn from ``seed``'s ``gradient_canaries`` stream; pass ``.recorder``
    to ``fit``'s callbacks."""
    if dp.ledger is None:
        raise ValueError("the DP model has no ledger, so there is no claim to audit: give it delta (make_private does)")
    variable = variable if variable is not None else head_kernel(dp.model)
    count = count if count is not None else min(DEFAULT_CANARIES, int(np.prod(variable.shape)))
    canaries = GradientCanaries(variable, count, seed, dp.clip_norm)
    dp.attach_canaries(canaries)
    return PlantedCanaries(canaries, canary_values(canaries), CanaryObservations(canaries))


@dataclasses.dataclass(frozen=True)
class Charged:
    """What the ledger charged for each observed step: ``sigma``, the rate ``q`` at which the step samples a
    participant (``q_b`` under cyclic sampling) and the bands of the noise."""

    noise_multiplier: float
    sample_rate: float
    bands: int


def charged_mechanism(ledger, steps: list[int], steps_run: int) -> Charged:
    """What ``ledger`` charged for the global DP ``steps`` of a model whose ``dp_step`` is ``steps_run``.

    The ledger's DP-step charges (kind ``dp_sgd_step``; not a loaded mask's cost, not the re-charge of an
    interrupted run's steps) are, in order, one per step, and the last of them is step ``steps_run - 1``: ``N``
    charged steps are steps ``steps_run - N .. steps_run - 1``. ValueError (one line) when no step observed
    the canaries, when one of them is not among the charged steps, or when they were charged at different
    values (the white-box checks test one claimed mechanism)."""
    if not steps:
        raise ValueError(NOT_OBSERVED)
    charges = [entry for entry in ledger.entries
               if entry.kind == DEFAULT_KIND and not is_mask_charge(entry) and entry.phase != INTERRUPTED]
    ends = np.cumsum([entry.count for entry in charges], dtype=np.int64)  # charged steps through each entry
    first = steps_run - (int(ends[-1]) if charges else 0)  # the global step of the first charged one
    found = set()
    for step in steps:
        if not first <= step < steps_run:
            raise ValueError(f"the ledger charges DP steps {first} to {steps_run - 1}, not step {step} that observed "
                             "the canaries; audit a model whose ledger charged every step it ran")
        entry = charges[int(np.searchsorted(ends, step - first, side="right"))]
        found.add((entry.noise_multiplier, entry.sample_rate, entry.bands))
    if len(found) > 1:
        raise ValueError(f"the ledger charged the steps that observed the canaries at {len(found)} different "
                         f"(noise multiplier, sample rate, bands): {sorted(found)}; audit one mechanism at a time")
    return Charged(*found.pop())


def white_box_report(dp, planted: PlantedCanaries, confidence: float = 0.95, other_bounds: int = 0) -> WhiteBoxAudit:
    """The bounds and checks of a finished ``fit`` against ``dp``'s ledger (:mod:`sparta_tf.audit.white_box`):
    ``sigma``, ``q`` and the bands its ledger charged for the observed steps (:func:`charged_mechanism`), ``C``
    the canaries'. ``confidence`` is the verdict's, shared with ``other_bounds`` further bounds (the black box's
    in the same run; :func:`~sparta_tf.audit.white_box.verdict_levels`)."""
    steps = planted.recorder.steps
    charged = charged_mechanism(dp.ledger, steps, int(dp.dp_step.numpy()))
    clip_norm = planted.canaries.clip_norm
    factor = None
    if charged.bands > 1:  # the claimed factorization (the analysis's), not the one the noise used
        claimed = BandedFactorization(charged.bands, dp._masked_optimizer.workload_momentum).coefficients
        factor = whitening_factor(claimed, steps)
    audit = white_box_audit(planted.recorder.array, planted.canaries.included, planted.initial,
                            canary_values(planted.canaries), claimed_epsilon=dp.ledger.epsilon(),
                            delta=dp.ledger.delta, sample_rate=charged.sample_rate,
                            noise_std=charged.noise_multiplier * clip_norm, clip_norm=clip_norm, factor=factor,
                            confidence=confidence, other_bounds=other_bounds)
    if factor is not None:  # the yardstick simulates independent noise
        return audit
    expected = simulated_bound(charged.noise_multiplier, charged.sample_rate, audit.observed_steps, audit.canaries,
                               audit.delta, confidence=audit.levels.bound)
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
