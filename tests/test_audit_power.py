"""The white-box audit's yardstick (:mod:`sparta_tf.audit.power`): the bound of an exact mechanism, simulated.

The claims it must respect come from elsewhere: the mechanism's epsilon from dp-accounting (an independent
calibration of sigma to the claim), the ceiling from the bound's closed form (:func:`ceiling`).
"""

import importlib.util
import json
import os

import numpy as np
import pytest
from scipy import optimize

from sparta_tf.audit import ceiling
from sparta_tf.audit.power import SimulatedBound, simulated_bound, simulated_scores
from sparta_tf.privacy.accounting import compute_epsilon

DELTA = 1e-5


def _sigma_for(epsilon: float, sample_rate: float, steps: int) -> float:
    return optimize.brentq(lambda s: compute_epsilon(s, sample_rate, steps, DELTA) - epsilon, 0.3, 60, xtol=1e-5)


@pytest.mark.parametrize("sample_rate, steps, epsilon", [(1.0, 1, 1.0), (0.5, 4, 2.0), (0.05, 100, 4.0)])
def test_an_exact_mechanism_at_its_claim_stays_below_it(sample_rate, steps, epsilon):
    bound = simulated_bound(_sigma_for(epsilon, sample_rate, steps), sample_rate, steps, 2000, DELTA, trials=5)
    assert 0 < bound.mean and bound.high <= epsilon and bound.low <= bound.mean <= bound.high


def test_without_noise_every_guess_is_right_and_the_bound_is_the_ceiling():
    bound = simulated_bound(1e-3, 1.0, 1, 500, DELTA, trials=2)
    assert bound.low == bound.high == pytest.approx(ceiling(500, DELTA), abs=1e-5)


def test_less_noise_or_more_sampling_shows_more():
    base = simulated_bound(2.0, 0.5, 8, 1000, DELTA, trials=3, seed=1).mean
    assert simulated_bound(1.0, 0.5, 8, 1000, DELTA, trials=3, seed=1).mean > base
    assert simulated_bound(2.0, 1.0, 8, 1000, DELTA, trials=3, seed=1).mean > base


def test_an_included_canary_is_sampled_at_the_rate_and_a_left_out_one_never():
    rng = np.random.default_rng(0)
    included = np.arange(4000) % 2 == 0
    noiseless = simulated_scores(rng, included, 1e-6, 0.25, 40)  # log-likelihood ratios: huge where sampled
    sampled_somewhere = noiseless > 0
    assert not sampled_somewhere[~included].any()
    assert sampled_somewhere[included].mean() == pytest.approx(1 - 0.75**40, abs=1e-3)


def test_impossible_settings_are_refused():
    with pytest.raises(ValueError, match="noise_multiplier > 0"):
        simulated_bound(0.0, 0.5, 10, 100, DELTA)


def test_the_power_benchmark_runs_as_many_trials_as_its_committed_results(tmp_path, monkeypatch):
    """``benchmarks/audit_power.py`` without options reproduces the committed table's trials per cell (it ran 5)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("audit_power", os.path.join(root, "benchmarks", "audit_power.py"))
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    trials = []
    monkeypatch.setattr(benchmark, "simulated_bound",
                        lambda *args, **kwargs: trials.append(kwargs["trials"]) or SimulatedBound(0, 0, 0, trials[-1]))
    assert benchmark.main(["--out", str(tmp_path / "power")]) == 0
    with open(os.path.join(root, "benchmarks", "results", "audit-power.json")) as f:
        committed = json.load(f)
    assert set(trials) == {committed["trials"]} == {20}
