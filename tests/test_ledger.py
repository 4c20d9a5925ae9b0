"""Tests for sparta_tf.privacy.ledger.PrivacyLedger."""

import json
import math
import os

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from sparta_tf.privacy import accounting
from sparta_tf.privacy.ledger import LedgerEntry, PrivacyLedger

DELTA = 1e-5
# Two phases with different mechanisms: (sigma, q, steps).
WARMUP = (1.5, 0.02, 30)
SPARSE = (2.5, 0.05, 20)


def _subsampled(sigma, q):
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))


def _two_phase_ledger(accountant="pld", **kwargs):
    ledger = PrivacyLedger(DELTA, accountant=accountant, **kwargs)
    sigma, q, steps = WARMUP
    for _ in range(steps):  # one record per step, as a training loop would
        ledger.record(sigma, q, phase="warmup")
    sigma, q, steps = SPARSE
    ledger.record(sigma, q, count=steps, phase="sparse")
    return ledger


def _independent(accountant):
    """dp_accounting's own composition of the same two phases, built step by step."""
    for sigma, q, steps in (WARMUP, SPARSE):
        for _ in range(steps):
            accountant.compose(_subsampled(sigma, q))
    return accountant


def test_rdp_ledger_epsilon_equals_dp_accounting():
    ledger = _two_phase_ledger("rdp")
    expected = _independent(rdp_privacy_accountant.RdpAccountant()).get_epsilon(DELTA)
    assert ledger.epsilon() == pytest.approx(expected, rel=1e-12)
    single_phase = accounting.compute_epsilon(*WARMUP, DELTA, "rdp")
    assert ledger.epsilon() > single_phase


def test_pld_ledger_epsilon_equals_dp_accounting():
    ledger = _two_phase_ledger("pld")
    event = dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(_subsampled(s, q), n) for s, q, n in (WARMUP, SPARSE)]
    )
    pld = pld_privacy_accountant.PLDAccountant
    by_interval = [
        pld(value_discretization_interval=h).compose(event).get_epsilon(DELTA)
        for h in accounting.PLD_INTERVALS[:5]
    ]
    eps = ledger.epsilon()
    assert any(eps == pytest.approx(value, rel=1e-12) for value in by_interval)
    assert by_interval[-1] * (1 - 1e-9) <= eps <= by_interval[-1] * (1 + 2e-3)  # h = 1e-4


def test_consecutive_identical_records_are_merged():
    ledger = _two_phase_ledger("rdp")
    assert ledger.entries == (
        LedgerEntry(1.5, 0.02, 30, "dp_sgd_step", "warmup"),
        LedgerEntry(2.5, 0.05, 20, "dp_sgd_step", "sparse"),
    )
    assert ledger.steps == 50
    ledger.record(2.5, 0.05, count=0, phase="sparse")  # nothing
    ledger.record(2.5, 0.05, count=2, kind="sparta_selection", phase="sparse")  # other kind
    ledger.record(2.5, 0.05, count=3, phase="sparse")  # not consecutive with the first
    assert [e.count for e in ledger.entries] == [30, 20, 2, 3]
    assert ledger.steps == 55


def test_banded_charges_of_interrupted_steps_are_never_merged():
    """Two kills before one checkpoint replay the same steps: 3 + 3 interrupted steps at b = 8 are two runs
    of the mechanism, not ceil(6 / 8) = 1."""
    ledger = PrivacyLedger(1e-5)
    for _ in range(2):
        ledger.charge(LedgerEntry(2.0, 0.4, 3, "dp_sgd_step", "interrupted", bands=8))
    assert [e.compositions for e in ledger.entries] == [1, 1]
    plain = PrivacyLedger(1e-5)
    for _ in range(2):
        plain.charge(LedgerEntry(2.0, 0.05, 3, "dp_sgd_step", "interrupted"))
    assert [e.count for e in plain.entries] == [6]  # independent noise: the count is what matters


def test_as_dp_event_composes_one_self_composed_event_per_entry():
    ledger = _two_phase_ledger("rdp")
    assert ledger.as_dp_event() == dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(_subsampled(s, q), n) for s, q, n in (WARMUP, SPARSE)]
    )


def test_epsilon_if_plans_without_recording():
    ledger = _two_phase_ledger("rdp")
    before = ledger.epsilon()
    planned = ledger.epsilon_if([(2.5, 0.05, 10, "dp_sgd_step", "sparse")])
    assert planned > before
    assert ledger.epsilon() == before and ledger.steps == 50
    ledger.record(2.5, 0.05, count=10, phase="sparse")
    assert ledger.epsilon() == planned
    assert ledger.epsilon_if([]) == planned


def test_fits_budget():
    ledger = _two_phase_ledger("rdp")
    assert ledger.fits_budget([(1.0, 0.5, 100)])  # no target: always fits
    ledger.target_epsilon = ledger.epsilon() * 1.05
    assert ledger.fits_budget()
    assert not ledger.fits_budget([(1.0, 0.5, 100)])


def test_empty_ledger_spends_nothing():
    ledger = PrivacyLedger(DELTA)
    assert ledger.epsilon() == 0.0 and ledger.steps == 0 and ledger.is_private


def test_nonprivate_runs_make_epsilon_infinite():
    ledger = _two_phase_ledger("rdp")
    ledger.record_nonprivate("evaluated on the training set without noise")
    assert ledger.epsilon() == math.inf
    assert not ledger.is_private
    assert ledger.epsilon_if([(10.0, 0.01, 1)]) == math.inf
    assert "NOT differentially private" in ledger.report()
    assert "evaluated on the training set without noise" in ledger.report()
    assert PrivacyLedger.from_json(ledger.to_json()).epsilon() == math.inf
    noiseless = PrivacyLedger(DELTA)
    noiseless.record(0.0, 0.01)
    assert noiseless.epsilon() == math.inf and not noiseless.is_private


@pytest.mark.parametrize("sigma", [None, math.inf, -1.0])
def test_record_rejects_invalid_noise(sigma):
    with pytest.raises(ValueError, match="noise_multiplier"):
        PrivacyLedger(DELTA).record(sigma, 0.01)


def test_constructor_validates():
    with pytest.raises(ValueError, match="accountant"):
        PrivacyLedger(DELTA, accountant="moments")
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(0.0)
    with pytest.raises(ValueError, match="target_epsilon"):
        PrivacyLedger(DELTA, target_epsilon=-1.0)


def test_json_round_trip_preserves_everything(tmp_path):
    ledger = _two_phase_ledger("pld", target_epsilon=3.0, sampling="shuffle")
    ledger.record(np.float32(2.5), np.float64(0.05), count=np.int64(4), kind="sparta_selection")
    data = json.loads(json.dumps(ledger.to_json()))
    assert data["version"] == 1 and data["sampling"] == "shuffle" and data["target_epsilon"] == 3.0
    restored = PrivacyLedger.from_json(data)
    assert restored.entries == ledger.entries
    assert restored.epsilon() == ledger.epsilon()
    assert (restored.delta, restored.accountant, restored.target_epsilon, restored.sampling) == (
        DELTA, "pld", 3.0, "shuffle")

    path = tmp_path / "run" / "privacy_ledger.json"
    ledger.save(path)
    ledger.record(2.5, 0.05)
    ledger.save(path)  # overwrite in place
    assert sorted(os.listdir(path.parent)) == ["privacy_ledger.json"]  # no temp files left
    loaded = PrivacyLedger.load(path)
    assert loaded.entries == ledger.entries
    assert loaded.epsilon() == ledger.epsilon()


def test_from_json_rejects_unknown_version():
    data = PrivacyLedger(DELTA).to_json()
    data["version"] = 99
    with pytest.raises(ValueError, match="version"):
        PrivacyLedger.from_json(data)


def test_report_lists_budget_and_phases():
    ledger = _two_phase_ledger("rdp", target_epsilon=5.0)
    report = ledger.report()
    assert f"{ledger.epsilon():.4f}" in report
    assert "1e-05" in report and "rdp" in report and "target 5" in report
    assert "phase warmup: 30 x dp_sgd_step, noise_multiplier=1.5, sample_rate=0.02" in report
    assert "phase sparse: 20 x dp_sgd_step, noise_multiplier=2.5, sample_rate=0.05" in report
    assert "WARNING" not in report
    assert "covers        : the weights after every step" in report
    assert "not the logged metrics" in report


def test_report_claims_no_coverage_when_not_private():
    ledger = _two_phase_ledger("rdp")
    ledger.record_nonprivate("an oracle mask")
    assert "covers" not in ledger.report()


def test_report_states_poisson_assumption_for_shuffled_batches():
    report = _two_phase_ledger("rdp", sampling="shuffle").report()
    assert "assumes Poisson sampling" in report
    assert "does not cover fixed-size shuffled batches" in report
