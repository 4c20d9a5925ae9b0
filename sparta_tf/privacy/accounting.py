"""Privacy accounting for DP-SGD-style training, built on ``dp_accounting``.

The mechanism
-------------
One training step of DP-SGD (and each step of SPARTA's selection epoch) is a
*Poisson-subsampled Gaussian mechanism*: every example joins the batch ``B``
independently with probability ``q`` (the *sample rate*), the clipped
per-example contributions (L2 sensitivity ``C``) are summed and Gaussian noise
``N(0, sigma^2 C^2 I)`` is added::

    M_{q,sigma}(D) = sum_{i in B} clip_C(g_i) + N(0, sigma^2 C^2 I),
    B = {i : b_i = 1},  b_i ~ Bernoulli(q) i.i.d.

``sigma`` is the *noise multiplier*. In ``dp_accounting`` this is
``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``; ``T`` steps are its
``T``-fold self-composition (``SelfComposedDpEvent``). With ``q = 1`` it is the
plain Gaussian mechanism, whose ``T``-fold composition is exactly one Gaussian
mechanism with noise multiplier ``sigma / sqrt(T)``.

For a run, ``epsilon(delta)`` is the smallest ``epsilon`` such that the whole
composition is ``(epsilon, delta)``-DP under the add/remove-one neighbouring
relation (the relation that Poisson subsampling amplification requires).

Accountants
-----------
``"pld"`` (default)
    Privacy loss distributions (``dp_accounting.pld.PLDAccountant``), a tight
    numerical upper bound. Its accuracy depends on the grid step of the
    privacy-loss values (``value_discretization_interval``, ``h``): the
    pessimistic connect-the-dots estimate over-states ``epsilon`` by roughly
    ``c * T * h^2`` (measured here: ``+2.2%`` at ``h = 1e-4`` for
    ``sigma = 50, q = 0.01, T = 5000``; ``+100%`` at ``h = 1e-3``), while the
    cost grows like ``1/h`` and is largest where the error is smallest
    (small ``sigma``, large ``epsilon``). No single ``h`` is both accurate and
    fast everywhere, so :class:`RefinedPLDAccountant` walks down the grid
    ``PLD_INTERVALS`` (``1e-2`` ... ``1e-5``, factor ``sqrt(10)``) and stops
    when two successive estimates agree to ``PLD_RTOL`` (relative). Every
    estimate is a valid upper bound; the returned one is the finest computed.
``"rdp"``
    Renyi DP (``dp_accounting.rdp.RdpAccountant``, default orders), looser by
    typically 5-15% but fast and analytic. Calibrating for either accountant
    runs RDP first (the PLD search starts from the RDP root).

dp-accounting 0.6 (the TF 2.21 line; 0.4.3 on the TF 2.15 line does not)
logs an absl WARNING for each Renyi order whose series it cannot sum
(``_compute_log_a_frac failed to converge ... Excluding this order``): tens
of lines in a calibration whose search tries small noise multipliers (a large
target epsilon, e.g. 30 at q = 0.1 over 10 steps). The order is left out and the epsilon stays a valid upper bound
(the minimum over the other orders), so the notes say nothing a user can act
on: :func:`make_accountant` installs :func:`drop_rdp_convergence_notes` on the
``absl`` logger before it makes an RDP accountant, which drops exactly those
records (every other absl record passes; the command-line tools rely on it).

Only ``dp_accounting`` does privacy math here; this module composes events,
picks discretisations and validates arguments. Calibrating ``sigma`` is
:mod:`sparta_tf.privacy.calibration`'s (called by the plan only).
"""

from __future__ import annotations

import collections
import logging
import math
import numbers
import pickle
from typing import Callable

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from sparta_tf import run_checks
from sparta_tf.choices import ACCOUNTANTS  # the names accepted wherever an ``accountant`` argument is taken

PLD_INTERVALS: tuple[float, ...] = (1e-2, 10**-2.5, 1e-3, 10**-3.5, 1e-4, 10**-4.5, 1e-5)
"""PLD discretisation intervals tried by :class:`RefinedPLDAccountant`, coarse to fine."""

PLD_RTOL: float = 1e-3
"""Stop refining when two successive PLD estimates differ by at most this (relative)."""

PLD_MIN_DELTA: float = 1e-15
"""The PLD accountant truncates tail mass near this size: below it, it can only answer epsilon = inf."""

EPSILON_CACHE_SIZE: int = 4096
"""How many ``epsilon(event, delta)`` values :func:`epsilon_of_event` keeps (least recently used dropped)."""

_epsilon_cache: "collections.OrderedDict[tuple[bytes, float, str], float]" = collections.OrderedDict()


class PrivacyBudgetExceededError(ValueError):
    """A planned or running computation would spend more than the target epsilon."""


# --------------------------------------------------------------------------
# Argument validation (one-line messages naming the argument and the fix).
# --------------------------------------------------------------------------


def check_accountant(accountant: str) -> str:
    """Returns ``accountant`` if it is one of :data:`ACCOUNTANTS`, else raises."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}.")
    return accountant


def check_resolvable(delta: float, accountant: str) -> None:
    """ValueError (one line) for a ``delta`` the ``accountant`` cannot resolve (PLD below ``PLD_MIN_DELTA``)."""
    if accountant == "pld" and delta < PLD_MIN_DELTA:
        raise ValueError(f"delta={delta:g} is below {PLD_MIN_DELTA:g}, the smallest delta the PLD accountant "
                         "resolves; use the rdp accountant (accountant: rdp) or a larger delta")


def check_sample_rate(sample_rate: float) -> float:
    """Returns ``q`` as float if ``0 < q <= 1``, else raises."""
    if not _is_real(sample_rate) or not 0.0 < float(sample_rate) <= 1.0:
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate!r}; "
            "pass the Poisson rate q = expected_batch_size / dataset_size."
        )
    return float(sample_rate)


def check_delta(delta: float) -> float:
    """Returns ``delta`` as float if ``0 < delta < 1``, else raises."""
    if not _is_real(delta) or not 0.0 < float(delta) < 1.0:
        raise ValueError(
            f"delta must be in (0, 1), got {delta!r}; the usual choice is delta < 1/dataset_size."
        )
    return float(delta)


def check_delta_for_dataset(delta: float, dataset_size: int) -> None:
    """Raises unless ``delta < 1/n`` (:func:`sparta_tf.run_checks.delta_problem`, the check the config
    makes too)."""
    problem = run_checks.delta_problem(delta, dataset_size)
    if problem:
        raise ValueError(f"delta={delta:g} {problem}")


def check_steps(steps: int, name: str = "steps") -> int:
    """Returns ``steps`` as int if it is an integer ``>= 0``, else raises."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {steps!r}.")
    return int(steps)


def check_noise_multiplier(noise_multiplier: float) -> float:
    """Returns ``sigma`` as float if it is finite and ``>= 0``, else raises."""
    if not _is_real(noise_multiplier) or not 0.0 <= float(noise_multiplier) < math.inf:
        raise ValueError(
            f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}; "
            "use noise_multiplier=0 (epsilon = inf) for a run without noise."
        )
    return float(noise_multiplier)


def check_target_epsilon(target_epsilon: float) -> float:
    """Returns ``epsilon`` as float if it is finite and ``> 0``, else raises."""
    if not _is_real(target_epsilon) or not 0.0 < float(target_epsilon) < math.inf:
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")
    return float(target_epsilon)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(float(x))


# --------------------------------------------------------------------------
# Accountants.
# --------------------------------------------------------------------------


class RefinedPLDAccountant(dp_accounting.PrivacyAccountant):
    """PLD accountant that refines its discretisation until ``epsilon`` converges.

    ``get_epsilon(delta)`` composes the recorded events with
    ``PLDAccountant(value_discretization_interval=h)`` for ``h`` in
    ``intervals`` (coarse to fine) and returns ``eps_h`` for the first ``h``
    with ``|eps_h_prev - eps_h| <= rtol * eps_h`` (or the finest one). Each
    ``eps_h`` is a pessimistic (valid) PLD estimate; with a grid ratio of
    ``sqrt(10)`` and an error ``O(h^2)`` the remaining over-estimate is about
    ``rtol / 9`` relative. The composition itself is dp_accounting's; this class
    only stores the events (the base class's ``ledger``) and picks ``h``.
    """

    def __init__(
        self, intervals: tuple[float, ...] = PLD_INTERVALS, rtol: float = PLD_RTOL
    ) -> None:
        super().__init__(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        self._intervals = tuple(intervals)
        self._rtol = rtol
        self.last_interval: float | None = None
        """The interval that produced the last returned value (None before any)."""

    def _maybe_compose(self, event, count, do_compose):
        # Support check only; events are kept by the base class's ledger.
        return pld_privacy_accountant.PLDAccountant()._maybe_compose(event, count, False)

    def _at(self, interval: float) -> pld_privacy_accountant.PLDAccountant:
        pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
        return pld.compose(self.ledger)

    def _refine(self, value_at: Callable[[float], float]) -> float:
        previous = None
        for interval in self._intervals:
            value = value_at(interval)
            self.last_interval = interval
            if not math.isfinite(value) or value == 0.0:
                return value
            if previous is not None and abs(previous - value) <= self._rtol * value:
                return value
            previous = value
        return value

    def get_epsilon(self, target_delta: float) -> float:
        """Refined PLD ``epsilon`` at ``target_delta`` (see class docstring)."""
        return self._refine(lambda h: self._at(h).get_epsilon(target_delta))

    def get_delta(self, target_epsilon: float) -> float:
        """Refined PLD ``delta`` at ``target_epsilon`` (same refinement rule)."""
        return self._refine(lambda h: self._at(h).get_delta(target_epsilon))


def make_accountant(name: str = "pld") -> dp_accounting.PrivacyAccountant:
    """Returns a fresh accountant: ``"pld"`` -> :class:`RefinedPLDAccountant`,
    ``"rdp"`` -> ``dp_accounting.rdp.RdpAccountant()`` (add/remove-one), whose convergence notes
    :func:`drop_rdp_convergence_notes` drops."""
    check_accountant(name)
    if name == "pld":
        return RefinedPLDAccountant()
    drop_rdp_convergence_notes()
    return rdp_privacy_accountant.RdpAccountant()


RDP_CONVERGENCE_NOTE = "_compute_log_a_frac failed to converge"
"""How dp-accounting's note on a Renyi order it leaves out begins (its format string; see the module doc)."""


def _not_an_rdp_convergence_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(RDP_CONVERGENCE_NOTE)


def drop_rdp_convergence_notes() -> None:
    """Drops dp-accounting's "failed to converge ... Excluding this order" records (see the module doc)
    from the ``absl`` logger it logs through; every other record passes. Idempotent; called by
    :func:`make_accountant`. ``logging.getLogger("absl").filters`` holds the filter, for whoever wants
    the notes back."""
    absl_logger = logging.getLogger("absl")
    if _not_an_rdp_convergence_note not in absl_logger.filters:
        absl_logger.addFilter(_not_an_rdp_convergence_note)


# --------------------------------------------------------------------------
# Events and epsilon.
# --------------------------------------------------------------------------


def gaussian_step_event(noise_multiplier: float, sample_rate: float) -> dp_accounting.DpEvent:
    """One step: ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``; ``q = 1`` -> Gaussian."""
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    return gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)


def dp_sgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    """``steps`` compositions of :func:`gaussian_step_event` (``NoOpDpEvent`` for 0 steps)."""
    steps = check_steps(steps)
    step = gaussian_step_event(noise_multiplier, sample_rate)
    if steps == 0:
        return dp_accounting.NoOpDpEvent()
    return dp_accounting.SelfComposedDpEvent(step, steps)


def pooled_event(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """``event`` with the runs of each distinct mechanism of a composition pooled into one::

        M_1^{n_1} o M_2^{n_2} o M_1^{n_3}   ->   M_1^{n_1 + n_3} o M_2^{n_2}

    The same guarantee: adaptive composition is associative and commutative, and ``n`` runs of one
    mechanism followed by ``m`` more are ``n + m`` runs of it, so every accountant bounds the same
    mechanism (RDP gives the same number; PLD's self-composition of one distribution is a valid
    pessimistic estimate of it too, and ``k`` times cheaper than ``k`` convolutions). Nested
    compositions are flattened, ``NoOpDpEvent`` dropped (first appearance sets the order); an event that
    is not a composition (e.g. a private tuning's ``RepeatAndSelectDpEvent``) is returned unchanged.
    """
    if not isinstance(event, (dp_accounting.ComposedDpEvent, dp_accounting.SelfComposedDpEvent)):
        return event
    mechanisms: list[dp_accounting.DpEvent] = []
    counts: list[int] = []
    for mechanism, count in _runs(event, 1):
        if mechanism in mechanisms:
            counts[mechanisms.index(mechanism)] += count
        else:
            mechanisms.append(mechanism)
            counts.append(count)
    pooled = [dp_accounting.SelfComposedDpEvent(m, n) if n > 1 else m for m, n in zip(mechanisms, counts)]
    if not pooled:
        return dp_accounting.NoOpDpEvent()
    return pooled[0] if len(pooled) == 1 else dp_accounting.ComposedDpEvent(pooled)


def _runs(event: dp_accounting.DpEvent, times: int):
    """``(mechanism, count)`` pairs of a (nested) composition run ``times`` times."""
    if isinstance(event, dp_accounting.ComposedDpEvent):
        for inner in event.events:
            yield from _runs(inner, times)
    elif isinstance(event, dp_accounting.SelfComposedDpEvent):
        if event.count:
            yield from _runs(event.event, times * event.count)
    elif not isinstance(event, dp_accounting.NoOpDpEvent):
        yield event, times


def epsilon_of_event(
    event: dp_accounting.DpEvent, delta: float, accountant: str = "pld"
) -> float:
    """``epsilon(delta)`` of ``event`` (:func:`pooled_event`) under a fresh :func:`make_accountant`
    accountant.

    Returns ``inf`` if the event contains a non-private part
    (``NonPrivateDpEvent`` or a Gaussian with ``sigma = 0``).
    """
    delta = check_delta(delta)
    check_resolvable(delta, check_accountant(accountant))
    event = pooled_event(event)
    # A pure function of its arguments, memoised on the event's pickle: every field with its
    # exact value and type (a float32 sigma and its float64 rounding get separate entries).
    key = (pickle.dumps(event), delta, accountant)
    if key in _epsilon_cache:
        _epsilon_cache.move_to_end(key)
        return _epsilon_cache[key]
    epsilon = float(make_accountant(accountant).compose(event).get_epsilon(delta))
    _epsilon_cache[key] = epsilon
    if len(_epsilon_cache) > EPSILON_CACHE_SIZE:
        _epsilon_cache.popitem(last=False)
    return epsilon


def compute_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
) -> float:
    """``epsilon(delta)`` of ``steps`` Poisson-subsampled Gaussian steps ``M_{q,sigma}``.

    ``steps = 0`` -> ``0``; ``sigma = 0`` with ``steps > 0`` -> ``inf``.
    """
    event = dp_sgd_event(noise_multiplier, sample_rate, steps)
    check_delta(delta)
    check_accountant(accountant)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return epsilon_of_event(event, delta, accountant)


def step_epsilon_lower_bound(noise_multiplier: float, sample_rate: float, delta: float) -> float:
    """A lower bound on ``epsilon(delta)`` of one step ``M_{q,sigma}``, and so of every run that contains
    such a step (a run's output includes the step's, and post-processing cannot raise epsilon), in
    microseconds where a PLD accountant can take minutes (``sigma = 0.01``: a 10^6-bin grid).

    Only the "remove" direction is used (``P = (1-q) N(0, sigma^2) + q N(1, sigma^2)`` against
    ``Q = N(0, sigma^2)``, sensitivity 1), whose hockey-stick divergence is exact in closed form: the
    privacy loss ``L(x) = log(1 - q + q exp((2x - 1) / (2 sigma^2)))`` increases in ``x``, so with
    ``x*(eps) = sigma^2 log((e^eps - 1 + q) / q) + 1/2``::

        delta(eps) = q Phi((1 - x*) / sigma) - q exp((2x* - 1) / (2 sigma^2)) Phi(-x* / sigma)

    Returns the largest ``eps`` found (by bisection) with ``delta(eps) > 1.01 delta``: the step is not
    ``(eps, delta)``-DP there, so its epsilon, the true epsilon of any run containing it, and every
    valid accountant's estimate (PLD, RDP) exceed the value returned. ``inf`` for ``sigma = 0``.
    """
    from scipy.special import log_ndtr

    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    delta = check_delta(delta)
    if sigma == 0:
        return math.inf

    def delta_at(eps: float) -> float:
        log_ratio = eps + math.log1p(-(1.0 - q) * math.exp(-eps)) - math.log(q)  # log((e^eps - 1 + q) / q)
        x = sigma * sigma * log_ratio + 0.5
        return q * math.exp(log_ndtr((1.0 - x) / sigma)) - math.exp(math.log(q) + log_ratio + log_ndtr(-x / sigma))

    def exceeded(eps: float) -> bool:
        return delta_at(eps) > 1.01 * delta

    if not exceeded(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while exceeded(high):
        low, high = high, 2.0 * high
        if high > 1e12:
            return low
    for _ in range(60):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if exceeded(middle) else (low, middle)
    return low
