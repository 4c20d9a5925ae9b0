"""Tests for sparta_tf.privacy.accounting (epsilon, calibration, validation)."""

import importlib.metadata
import math
import os
import subprocess
import sys

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from sparta_tf.privacy import accounting
from sparta_tf.privacy.accounting import (
    PrivacyBudgetExceededError,
    compute_epsilon,
    epsilon_of_event,
    make_accountant,
)
from sparta_tf.privacy import calibration
from sparta_tf.privacy.calibration import calibrate_noise_multiplier

DELTA = 1e-5


def _pld(interval: float) -> pld_privacy_accountant.PLDAccountant:
    return pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)


def _subsampled(sigma: float, q: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))


def test_zero_steps_cost_nothing_and_zero_noise_costs_everything():
    assert compute_epsilon(1.0, 0.01, 0, DELTA) == 0.0
    assert compute_epsilon(0.0, 0.01, 0, DELTA) == 0.0
    for name in accounting.ACCOUNTANTS:
        assert compute_epsilon(0.0, 0.01, 10, DELTA, name) == math.inf
        assert compute_epsilon(0.0, 1.0, 1, DELTA, name) == math.inf


def test_rdp_matches_dp_accounting_exactly():
    sigma, q, steps = 1.3, 0.02, 700
    expected = rdp_privacy_accountant.RdpAccountant().compose(_subsampled(sigma, q), steps)
    assert compute_epsilon(sigma, q, steps, DELTA, "rdp") == expected.get_epsilon(DELTA)


def test_pld_is_a_converged_upper_bound_of_dp_accounting_pld():
    sigma, q, steps = 1.5, 0.02, 300
    eps = compute_epsilon(sigma, q, steps, DELTA)
    event = _subsampled(sigma, q)
    by_interval = {h: _pld(h).compose(event, steps).get_epsilon(DELTA) for h in accounting.PLD_INTERVALS[:5]}
    assert eps in by_interval.values()  # one of dp_accounting's own PLD estimates
    fine = by_interval[1e-4]
    assert fine * (1 - 1e-9) <= eps <= fine * (1 + 2e-3)
    assert eps < compute_epsilon(sigma, q, steps, DELTA, "rdp")  # PLD is tighter than RDP


def test_refined_pld_delta_inverts_epsilon():
    event = accounting.dp_sgd_event(2.0, 0.05, 40)
    eps = make_accountant("pld").compose(event).get_epsilon(DELTA)
    assert make_accountant("pld").compose(event).get_delta(eps) == pytest.approx(DELTA, rel=0.05)


def test_full_batch_is_the_plain_gaussian_mechanism():
    sigma, steps = 4.0, 16
    # T compositions of a Gaussian with multiplier sigma == one with sigma / sqrt(T).
    single = epsilon_of_event(dp_accounting.GaussianDpEvent(sigma / math.sqrt(steps)), DELTA)
    assert compute_epsilon(sigma, 1.0, steps, DELTA) == pytest.approx(single, rel=2e-3)
    assert accounting.dp_sgd_event(sigma, 1.0, steps) == dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(sigma), steps
    )


@pytest.mark.parametrize("name", accounting.ACCOUNTANTS)
def test_epsilon_is_monotone(name):
    base = compute_epsilon(2.0, 0.02, 200, DELTA, name)
    assert compute_epsilon(2.5, 0.02, 200, DELTA, name) < base  # more noise
    assert compute_epsilon(2.0, 0.02, 400, DELTA, name) > base  # more steps
    assert compute_epsilon(2.0, 0.04, 200, DELTA, name) > base  # larger sample rate
    assert compute_epsilon(2.0, 0.02, 200, 1e-3, name) < base  # larger delta


def test_epsilon_of_event_handles_composition_and_nonprivate_events():
    event = accounting.dp_sgd_event(2.0, 0.05, 40)
    assert epsilon_of_event(event, DELTA) == compute_epsilon(2.0, 0.05, 40, DELTA)
    assert epsilon_of_event(dp_accounting.NoOpDpEvent(), DELTA) == 0.0
    for name in accounting.ACCOUNTANTS:
        mixed = dp_accounting.ComposedDpEvent([event, dp_accounting.NonPrivateDpEvent()])
        assert epsilon_of_event(mixed, DELTA, name) == math.inf


CALIBRATION_CASES = [
    # (target epsilon, q, steps, accountant)
    (1.0, 0.01, 5000, "pld"),  # paper-like: 50 epochs, batch 500 of 50k
    (3.0, 0.05, 200, "pld"),
    (0.5, 1.0, 10, "pld"),  # full batch
    (2.0, 0.01, 3000, "rdp"),
    (4.0, 0.1, 50, "rdp"),
]


@pytest.mark.parametrize("target,q,steps,name", CALIBRATION_CASES)
def test_calibrated_sigma_meets_target_tightly(target, q, steps, name):
    sigma = calibrate_noise_multiplier(target, DELTA, q, steps, accountant=name)
    eps = compute_epsilon(sigma, q, steps, DELTA, name)
    assert eps <= target
    assert eps >= 0.99 * target
    assert compute_epsilon(0.995 * sigma, q, steps, DELTA, name) > target  # near-smallest sigma


def test_pld_calibration_needs_less_noise_than_rdp():
    pld = calibrate_noise_multiplier(2.0, DELTA, 0.05, 100)
    rdp = calibrate_noise_multiplier(2.0, DELTA, 0.05, 100, accountant="rdp")
    assert pld < rdp


def test_calibration_rejects_unreachable_targets():
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(1e6, DELTA, 0.01, 10, accountant="rdp")
    with pytest.raises(ValueError, match="steps"):
        calibrate_noise_multiplier(1.0, DELTA, 0.01, 0)


def test_make_accountant():
    assert isinstance(make_accountant("pld"), accounting.RefinedPLDAccountant)
    assert isinstance(make_accountant("rdp"), rdp_privacy_accountant.RdpAccountant)
    with pytest.raises(ValueError) as info:
        make_accountant("gdp")
    message = str(info.value)
    assert "\n" not in message and "'pld'" in message and "'rdp'" in message and "gdp" in message


BAD_ARGUMENTS = [
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(noise_multiplier=math.inf), "noise_multiplier"),
    (dict(noise_multiplier=math.nan), "noise_multiplier"),
    (dict(sample_rate=0.0), "sample_rate"),
    (dict(sample_rate=1.5), "sample_rate"),
    (dict(steps=-1), "steps"),
    (dict(steps=2.5), "steps"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(accountant="moments"), "accountant"),
]


@pytest.mark.parametrize("override,argument", BAD_ARGUMENTS)
def test_invalid_arguments_give_one_line_errors_naming_the_argument(override, argument):
    kwargs = dict(noise_multiplier=1.0, sample_rate=0.01, steps=10, delta=DELTA, accountant="rdp")
    kwargs.update(override)
    with pytest.raises(ValueError) as info:
        compute_epsilon(**kwargs)
    assert str(info.value).startswith(argument)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("target", [0.0, -1.0, math.inf])
def test_calibration_rejects_bad_target(target):
    with pytest.raises(ValueError, match="^target_epsilon"):
        calibrate_noise_multiplier(target, DELTA, 0.01, 100)


def test_budget_error_is_a_value_error():
    assert issubclass(PrivacyBudgetExceededError, ValueError)


def _counting_accountants(monkeypatch) -> list:
    made = []
    real = accounting.make_accountant

    def counting(name="pld"):
        made.append(name)
        return real(name)

    monkeypatch.setattr(accounting, "make_accountant", counting)
    return made


def test_epsilon_of_equal_events_is_computed_once_and_unequal_ones_apart(monkeypatch):
    import numpy as np

    made = _counting_accountants(monkeypatch)
    event = accounting.dp_sgd_event(1.234567, 0.03, 77)
    first = epsilon_of_event(event, DELTA)
    calls = len(made)
    assert epsilon_of_event(accounting.dp_sgd_event(1.234567, 0.03, 77), DELTA) == first
    assert len(made) == calls  # memoised
    # A float32 sigma prints like its float64 neighbour but is another event: computed apart.
    float32_sigma = np.float32(1.234567)
    apart = epsilon_of_event(accounting.dp_sgd_event(float32_sigma, 0.03, 77), DELTA)
    assert len(made) > calls
    expected = make_accountant("pld").compose(accounting.dp_sgd_event(float(float32_sigma), 0.03, 77))
    assert apart == expected.get_epsilon(DELTA)
    # another delta or accountant is another value
    assert epsilon_of_event(event, DELTA * 10) < first
    assert epsilon_of_event(event, DELTA, "rdp") > first


def test_calibration_is_memoised_per_arguments(monkeypatch):
    made = _counting_accountants(monkeypatch)
    sigma = calibrate_noise_multiplier(3.1, DELTA, 0.07, 33)
    calls = len(made)
    assert calibrate_noise_multiplier(3.1, DELTA, 0.07, 33) == sigma
    assert len(made) == calls
    assert calibrate_noise_multiplier(3.1, DELTA, 0.07, 34) > sigma  # more steps need more noise


@pytest.mark.parametrize("sigma, q, delta", [(0.1, 0.13, 1e-4), (0.3, 0.1, 1e-5), (0.7, 1.0, 1e-5), (1.0, 0.1, 1e-5),
                                             (2.0, 0.01, 1e-5), (5.0, 0.5, 1e-6)])
def test_one_steps_epsilon_bounds_every_accountant_from_below_and_tightly(sigma, q, delta):
    """The closed-form epsilon of one step's remove direction: below PLD and RDP for one step and for
    any run containing it, within 1% of PLD's one-step estimate."""
    bound = accounting.step_epsilon_lower_bound(sigma, q, delta)
    one_step = compute_epsilon(sigma, q, 1, delta, "pld")
    assert 0.99 * one_step <= bound <= one_step
    assert bound <= compute_epsilon(sigma, q, 1, delta, "rdp")
    assert bound <= compute_epsilon(sigma, q, 20, delta, "pld")
    assert accounting.step_epsilon_lower_bound(0.0, q, delta) == math.inf


def test_a_fixed_noise_multiplier_over_the_target_is_refused_before_the_pld_work():
    import time

    from sparta_tf.method_spec import Phase
    from sparta_tf.privacy.plan import FixedNoiseOverBudgetError, make_privacy_plan

    start = time.monotonic()
    with pytest.raises(FixedNoiseOverBudgetError, match=r"noise_multiplier=0.01 spends epsilon > \d+ \(one step"):
        make_privacy_plan(n=645, expected_batch_size=64, phases=[Phase("train", 15)], delta=1e-4,
                          target_epsilon=4.0, noise_multiplier=0.01)
    assert time.monotonic() - start < 5  # PLD on this run: minutes
    with pytest.raises(FixedNoiseOverBudgetError, match=r"noise_multiplier=0.6 spends epsilon=2\d\.\d+ over"):
        make_privacy_plan(n=645, expected_batch_size=64, phases=[Phase("train", 15)], delta=1e-4,
                          target_epsilon=4.0, noise_multiplier=0.6)
    plan = make_privacy_plan(n=645, expected_batch_size=64, phases=[Phase("train", 15)], delta=1e-4,
                             target_epsilon=4.0, noise_multiplier=1.5)
    assert plan.epsilon <= 4.0


RDP_CONVERGENCE_NOTE = "_compute_log_a_frac failed to converge"  # how dp-accounting 0.6's notes begin

NOTES_SCRIPT = """
import sys
import dp_accounting
from absl import logging as absl_logging
from dp_accounting.rdp import rdp_privacy_accountant

event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(0.5))
rdp_privacy_accountant.RdpAccountant().compose(event)  # dp-accounting alone: its notes, if this version logs them
print("--- sparta_tf", file=sys.stderr, flush=True)
from sparta_tf.privacy import calibration
from sparta_tf.privacy.calibration import calibrate_noise_multiplier

calibrate_noise_multiplier(30.0, 1e-5, 0.1, 10, accountant="rdp")  # the bracket tries small noise multipliers
absl_logging.warning("another absl warning passes")
"""


def test_the_library_drops_dp_accountings_rdp_convergence_notes_and_nothing_else():
    """Regression: on the TF 2.21 line (dp-accounting 0.6) a library user calibrating at a large epsilon saw
    dozens of absl lines "_compute_log_a_frac failed to converge ... Excluding this order" (only the CLIs
    dropped them). A fresh process, as a library user's: dp-accounting alone shows whether this version logs
    the notes; after sparta_tf calibrates, none may appear, and another absl warning still does."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", NOTES_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    alone, _, with_sparta = result.stderr.partition("--- sparta_tf\n")
    if RDP_CONVERGENCE_NOTE not in alone:
        pytest.skip(f"dp-accounting {importlib.metadata.version('dp-accounting')} does not log the convergence "
                    "notes (0.6 does)")
    assert RDP_CONVERGENCE_NOTE not in with_sparta, with_sparta[-3000:]
    assert "another absl warning passes" in with_sparta, with_sparta[-3000:]


def test_pooled_event_merges_the_runs_of_each_mechanism_and_keeps_epsilon():
    """Three phases of one mechanism compose like one run of the summed count (RDP: the same number;
    PLD: within its discretisation), nested compositions flatten and no-ops drop."""
    a, b = accounting.gaussian_step_event(0.9, 0.05), accounting.gaussian_step_event(2.0, 0.2)
    split = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(a, 30), dp_accounting.NoOpDpEvent(),
        dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(b, 4), dp_accounting.SelfComposedDpEvent(a, 20)]),
        a,
    ])
    pooled = accounting.pooled_event(split)
    assert pooled == dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(a, 51),
                                                    dp_accounting.SelfComposedDpEvent(b, 4)])
    rdp = lambda event: accounting.make_accountant("rdp").compose(event).get_epsilon(1e-5)  # noqa: E731
    assert accounting.epsilon_of_event(split, 1e-5, "rdp") == pytest.approx(rdp(split), rel=1e-12)
    assert accounting.epsilon_of_event(split, 1e-5, "pld") == pytest.approx(
        accounting.make_accountant("pld").compose(split).get_epsilon(1e-5), rel=1e-3)
    assert accounting.pooled_event(dp_accounting.ComposedDpEvent([])) == dp_accounting.NoOpDpEvent()
    assert accounting.pooled_event(a) is a


def test_calibrating_the_phases_of_one_mechanism_equals_calibrating_their_sum():
    phases = calibration.calibrate_composition((), ((0.1, 30), (0.1, 30), (0.1, 40)), 4.0, 1e-5)
    assert phases == calibration.calibrate_composition((), ((0.1, 100),), 4.0, 1e-5)
