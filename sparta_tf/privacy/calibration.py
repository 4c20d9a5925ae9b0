"""Calibrating the noise multiplier: the smallest ``sigma`` that keeps a composition within a target.

For mechanisms ``M_k`` whose ``sigma_k`` is known (``fixed``) and mechanisms that share the unknown
``sigma`` (``unknown``), all Poisson-subsampled Gaussian mechanisms
(:mod:`sparta_tf.privacy.accounting`)::

    sigma* = min { sigma : epsilon_delta( (o_k M_k^{fixed})  o  (o_j M_{q_j, sigma}^{count_j}) ) <= target }

found as the root of ``epsilon(sigma) - target`` by ``dp_accounting.calibrate_dp_mechanism``
(Brent's method, nudged so that ``epsilon(sigma*) <= target``). Only the plan
(:mod:`sparta_tf.privacy.plan`) calls it for a run (``tests/test_one_mechanism.py`` checks that no
other module computes ``sigma``); :func:`calibrate_noise_multiplier` is the public one-mechanism form.
"""

from __future__ import annotations

import functools

import dp_accounting
from dp_accounting import mechanism_calibration

from sparta_tf.privacy import accounting

CALIBRATION_RTOL: float = 1e-4
"""Default relative tolerance on sigma in :func:`calibrate_noise_multiplier`."""

_SIGMA_SEARCH_RANGE = (1e-2, 1e6)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    rtol: float = CALIBRATION_RTOL,
) -> float:
    """Smallest ``sigma`` with ``epsilon(sigma) <= target_epsilon`` for ``steps`` steps.

    ``epsilon(sigma)`` is :func:`compute_epsilon`; the calibration is
    :func:`calibrate_composition` with no fixed mechanism.
    """
    accounting.check_sample_rate(sample_rate)
    if accounting.check_steps(steps) == 0:
        raise ValueError("steps must be >= 1 to calibrate a noise multiplier.")
    return calibrate_composition((), ((sample_rate, steps),), target_epsilon, delta, accountant, rtol)


Fixed = tuple  # ((sigma, q, count), ...): mechanisms whose noise multiplier is known
Unknown = tuple  # ((q, count), ...): mechanisms that share the noise multiplier being calibrated


def composition_event(fixed: Fixed, unknown: Unknown, sigma: float, wrap=None) -> dp_accounting.DpEvent:
    """``ComposedDpEvent`` of the fixed mechanisms and the unknown ones at noise multiplier ``sigma``
    (``wrap``: a function of that event whose epsilon is calibrated instead, e.g. a private tuning's
    :class:`~sparta_tf.privacy.tuning.Repetition`)."""
    events = [accounting.dp_sgd_event(s, q, count) for s, q, count in fixed]
    events += [accounting.dp_sgd_event(sigma, q, count) for q, count in unknown]
    event = accounting.pooled_event(dp_accounting.ComposedDpEvent(events))
    return event if wrap is None else wrap(event)


def calibrate_composition(
    fixed: Fixed,
    unknown: Unknown,
    target_epsilon: float,
    delta: float,
    accountant: str = "pld",
    rtol: float = CALIBRATION_RTOL,
    wrap=None,
) -> float:
    """The one calibrator: smallest ``sigma`` such that ``fixed`` composed with ``unknown`` at ``sigma``
    spends at most ``target_epsilon`` at ``delta`` (``wrap``: such that ``wrap`` of that composition
    does, e.g. the private tuning around a run; its accountant must be RDP).

    ``fixed``: ``((sigma, q, count), ...)`` mechanisms already decided (e.g.
    DP-SNIP's release, a loaded mask's selection epoch, DP-SGD when
    calibrating DP-FROST's selection rounds); ``unknown``: ``((q, count), ...)``
    mechanisms that all use the calibrated ``sigma``. The root of
    ``epsilon(sigma) - target`` is found by
    ``dp_accounting.calibrate_dp_mechanism`` (Brent's method), which searches
    its own bracket from ``LowerEndpointAndGuess`` and nudges the root so that
    ``epsilon(sigma) <= target`` holds for the returned value (to an absolute
    tolerance ``rtol * sigma``). For ``"pld"`` the search starts from the
    (fast, looser) RDP solution ``sigma_rdp``: RDP over-states epsilon, so the
    PLD root lies a little below it. With fixed mechanisms the search starts
    from the root without them, a lower bound of the root with them.
    """
    target = accounting.check_target_epsilon(target_epsilon)
    delta = accounting.check_delta(delta)
    accounting.check_resolvable(delta, accounting.check_accountant(accountant))
    fixed = tuple((float(accounting.check_noise_multiplier(s)), float(accounting.check_sample_rate(q)),
                   int(accounting.check_steps(c))) for s, q, c in fixed)
    unknown = tuple((float(accounting.check_sample_rate(q)), int(accounting.check_steps(c))) for q, c in unknown)
    if not any(count for _, count in unknown):
        raise ValueError("nothing to calibrate: no mechanism uses the unknown noise multiplier")
    if wrap is not None and accountant != "rdp":
        raise ValueError("a wrapped composition (a private tuning) is calibrated with the rdp accountant only")
    if fixed or wrap is not None:  # what no noise multiplier can lower: the fixed mechanisms and the wrap's cost
        spent = accounting.epsilon_of_event(composition_event(fixed, (), 1.0, wrap), delta, accountant)
        if spent >= target and wrap is None:
            raise ValueError(f"the mechanisms with a fixed noise multiplier already spend epsilon={spent:.4g} "
                             f">= target {target:g}; raise their noise multiplier or the target epsilon")
        if spent >= target:
            with_fixed = " with the mechanisms of a fixed noise multiplier" if fixed else ""
            raise ValueError(f"the tuning around the run{with_fixed} alone spends epsilon={spent:.4g} >= target "
                             f"{target:g}; raise the target epsilon, or lower the tuning's mean number of candidates")
    if wrap is not None:
        return _calibrated_wrapped(fixed, unknown, target, delta, rtol, wrap)
    return _calibrated(fixed, unknown, target, delta, accountant, rtol)


@functools.lru_cache(maxsize=256)
def _calibrated_wrapped(fixed: Fixed, unknown: Unknown, target: float, delta: float, rtol: float, wrap) -> float:
    """:func:`calibrate_composition` with ``wrap`` (RDP): searched upwards from the root without it (the
    wrap only adds epsilon, so its root lies above), memoised."""
    lower = _calibrated(fixed, unknown, target, delta, "rdp", rtol) if not fixed else \
        _calibrated_wrapped((), unknown, target, delta, rtol, wrap)
    search = mechanism_calibration.LowerEndpointAndGuess(lower * (1 - 1e-3), 1.5 * lower)
    return _solve(fixed, unknown, target, delta, "rdp", search, rtol, wrap)


@functools.lru_cache(maxsize=256)
def _calibrated(fixed: Fixed, unknown: Unknown, target: float, delta: float, accountant: str, rtol: float) -> float:
    """:func:`calibrate_composition` on validated arguments; memoised (a pure function, and the
    costliest call of a run's set-up: seconds of PLD compositions)."""
    if fixed:
        # Fixed mechanisms only add epsilon, so the root lies above the root without them: search
        # upwards from just below that one (dp_accounting doubles the interval until it brackets).
        lower = _calibrated((), unknown, target, delta, accountant, rtol) * (1 - 1e-3)
        search = mechanism_calibration.LowerEndpointAndGuess(lower, 2 * lower)
        return _solve(fixed, unknown, target, delta, accountant, search, rtol)
    smallest, _ = _SIGMA_SEARCH_RANGE
    rdp_floor = accounting.epsilon_of_event(composition_event(fixed, unknown, smallest), delta, "rdp")
    if rdp_floor <= target:
        raise ValueError(f"target_epsilon={target:g} is met even by noise_multiplier {smallest:g}; such a "
                         "guarantee is meaningless: use a smaller target_epsilon (e.g. 1 to 10)")
    search = mechanism_calibration.LowerEndpointAndGuess(smallest, 1.0)
    sigma_rdp = _solve(fixed, unknown, target, delta, "rdp", search, rtol)
    if accountant == "rdp":
        return sigma_rdp
    try:  # Common case: the PLD root lies in [0.8 sigma_rdp, sigma_rdp].
        narrow = mechanism_calibration.ExplicitBracketInterval(0.8 * sigma_rdp, sigma_rdp)
        return _solve(fixed, unknown, target, delta, "pld", narrow, rtol)
    except ValueError:  # Not bracketed: let dp_accounting search upwards from half the RDP root.
        wide = mechanism_calibration.LowerEndpointAndGuess(0.5 * sigma_rdp, sigma_rdp)
        return _solve(fixed, unknown, target, delta, "pld", wide, rtol)


def _solve(fixed: Fixed, unknown: Unknown, target: float, delta: float, accountant: str,
           bracket: mechanism_calibration.BracketInterval, rtol: float, wrap=None) -> float:
    guess = getattr(bracket, "initial_guess", None) or getattr(bracket, "endpoint_2")
    try:
        return float(mechanism_calibration.calibrate_dp_mechanism(
            lambda: accounting.make_accountant(accountant),
            lambda sigma: composition_event(fixed, unknown, sigma, wrap),
            target, delta, bracket_interval=bracket, tol=rtol * guess,
        ))
    except mechanism_calibration.NoBracketIntervalFoundError as error:
        raise ValueError(f"target_epsilon={target:g} needs a noise multiplier outside the searched range; "
                         "raise target_epsilon or lower the sample rate / number of steps") from error
