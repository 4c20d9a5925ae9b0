"""The one-run epsilon lower bound and the membership-attack statistics (pure math, no training)."""

import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from sparta_tf.audit import audit_scores, ceiling, epsilon_lower_bound, p_value, roc_auc, threshold_attack, tpr_at_fpr
from sparta_tf.audit.one_run import guess_grid

# Reference values computed with jax-privacy 2.0.0's implementation of the same theorem
# (jax_privacy/auditing.py: _one_run_p_value and _epsilon_one_run), run in a separate
# environment because jax-privacy cannot be installed beside TensorFlow 2.15 (ml-dtypes).
REFERENCE_P_VALUES = [  # m, r, v, epsilon, delta, p-value
    (1000, 100, 90, 1.0, 1e-5, 0.0008412885614385309),
    (100, 10, 10, 0.5, 1e-3, 0.04313615618059766),
    (1000, 100, 50, 0.0, 1e-6, 0.539950676021799),
    (10, 10, 9, 2.0, 0.1, 1.0),
]
REFERENCE_BOUNDS = [  # m, r, v, delta, significance, epsilon lower bound
    (1000, 100, 100, 0.0, 0.05, 3.492965346169885),
    (1000, 100, 90, 1e-5, 0.05, 1.6261436787042223),
    (1000, 200, 180, 1e-5, 0.05, 1.796285070718516),
    (100, 20, 20, 1e-5, 0.05, 1.819596907485671),
    (200, 50, 45, 1e-4, 0.05, 1.377089625582611),
    (500, 100, 80, 1e-6, 0.01, 0.8033555487213602),
    (1000, 1000, 700, 1e-5, 0.05, 0.7317406384658977),
    (50, 10, 6, 1e-5, 0.05, 0.0),
    (10000, 500, 450, 1e-6, 0.05 / 28, 1.7596156386278818),
]


@pytest.mark.parametrize("m, r, v, epsilon, delta, expected", REFERENCE_P_VALUES)
def test_p_value_matches_reference_implementation(m, r, v, epsilon, delta, expected):
    assert p_value(m, r, v, epsilon, delta) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("m, r, v, delta, significance, expected", REFERENCE_BOUNDS)
def test_lower_bound_matches_reference_implementation(m, r, v, delta, significance, expected):
    assert epsilon_lower_bound(m, r, v, delta, significance) == pytest.approx(expected, abs=2e-6)


@pytest.mark.parametrize("r", [1, 5, 10, 100, 1000])
def test_all_guesses_right_at_delta_zero_is_the_closed_form(r):
    # P[Binomial(r, p) >= r] = p^r = alpha  =>  eps = logit(alpha^(1/r)), or 0 when that is negative
    p = 0.05 ** (1 / r)
    expected = max(0.0, math.log(p / (1 - p)))
    assert epsilon_lower_bound(5000, r, r, 0.0, 0.05) == pytest.approx(expected, abs=2e-6)


def test_bound_is_the_first_epsilon_whose_p_value_exceeds_the_significance():
    m, r, v, delta = 1000, 200, 170, 1e-5
    bound = epsilon_lower_bound(m, r, v, delta, 0.05)
    assert p_value(m, r, v, bound, delta) <= 0.05 < p_value(m, r, v, bound + 1e-4, delta)
    grid = np.linspace(0, bound, 50)
    assert all(p_value(m, r, v, eps, delta) <= 0.05 for eps in grid)  # every smaller epsilon is rejected


def test_bound_grows_with_correct_guesses_and_shrinks_with_delta():
    bounds = [epsilon_lower_bound(1000, 100, v, 1e-5) for v in (60, 70, 80, 90, 100)]
    assert bounds == sorted(bounds) and bounds[0] < bounds[-1]
    by_delta = [epsilon_lower_bound(1000, 100, 95, d) for d in (0.0, 1e-6, 1e-4, 1e-3)]
    assert by_delta == sorted(by_delta, reverse=True) and by_delta[0] > by_delta[-1]


def test_chance_level_guessing_bounds_nothing():
    assert epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0
    assert epsilon_lower_bound(1000, 100, 0, 1e-5) == 0.0


@pytest.mark.parametrize("args", [(10, 11, 5), (10, 5, 6), (10, 5, -1)])
def test_impossible_counts_are_refused(args):
    with pytest.raises(ValueError, match="guesses"):
        epsilon_lower_bound(*args, 1e-5)


def test_guess_grid_depends_on_m_only():
    assert guess_grid(25) == [(1, 0), (2, 0), (5, 0), (10, 0), (1, 1), (2, 2), (5, 5), (10, 10)]
    assert all(kp + km <= 1000 for kp, km in guess_grid(1000))


def _randomised_response(m, epsilon, rng):
    """Scores of an exactly epsilon-DP mechanism: each canary's bit, flipped w.p. 1/(1+e^eps), + tie-breaking."""
    included = rng.random(m) < 0.5
    flip = rng.random(m) < 1 / (1 + math.exp(epsilon))
    return (included ^ flip) + 0.01 * rng.random(m), included


def test_bound_on_an_exactly_dp_mechanism_rarely_exceeds_its_epsilon():
    rng = np.random.default_rng(0)
    epsilon, trials = 2.0, 60
    bounds = [audit_scores(*_randomised_response(200, epsilon, rng), delta=0.0).epsilon_lower_bound
              for _ in range(trials)]
    assert np.mean(np.array(bounds) > epsilon) <= 0.05  # 95% confidence (Bonferroni makes it rarer still)
    assert np.median(bounds) > 0.5  # and the audit does see the leakage


def test_a_mechanism_without_privacy_reaches_the_ceiling():
    rng = np.random.default_rng(1)
    included = rng.permutation(400) < 200  # exactly half in: the top and bottom 200 can all be right
    result = audit_scores(included + rng.random(400), included, delta=1e-5)  # scores separate perfectly
    assert result.correct == result.guesses > 0
    assert result.epsilon_lower_bound == pytest.approx(ceiling(400, 1e-5), abs=1e-9)
    assert result.epsilon_lower_bound > 3


def test_scores_that_do_not_depend_on_membership_give_zero():
    rng = np.random.default_rng(2)
    result = audit_scores(rng.random(500), rng.random(500) < 0.5, delta=1e-5)
    assert result.epsilon_lower_bound < 0.5


def test_audit_scores_refuses_bad_input():
    with pytest.raises(ValueError, match="finite"):
        audit_scores([0.1, float("nan"), 0.3], [True, False, True], delta=1e-5)
    with pytest.raises(ValueError, match="same length"):
        audit_scores([0.1, 0.2], [True], delta=1e-5)
    with pytest.raises(ValueError, match="confidence"):
        audit_scores([0.1, 0.2], [True, False], delta=1e-5, confidence=95)


def test_auc_agrees_with_scikit_learn_including_ties():
    rng = np.random.default_rng(3)
    members, non_members = rng.integers(0, 5, 300) + 0.5, rng.integers(0, 5, 200).astype(float)
    expected = roc_auc_score(np.r_[np.ones(300), np.zeros(200)], np.r_[members, non_members])
    assert roc_auc(members, non_members) == pytest.approx(expected, abs=1e-12)
    assert roc_auc([2, 3], [0, 1]) == 1.0 and roc_auc([0, 1], [2, 3]) == 0.0 and roc_auc([1, 1], [1, 1]) == 0.5


def test_tpr_at_fpr_allows_only_that_many_false_positives():
    non_members = np.arange(10.0)          # 10 non-members: FPR steps of 0.1
    members = np.array([3.5, 8.5, 9.5, 10.0])
    assert tpr_at_fpr(members, non_members, 0.0) == 0.5    # only scores above 9 are safe
    assert tpr_at_fpr(members, non_members, 0.1) == 0.75   # one false positive (9) allowed
    assert tpr_at_fpr(members, non_members, 0.05) == 0.5   # 0.05 * 10 < 1 false positive
    assert tpr_at_fpr(members, non_members, 1.0) == 1.0
    roc = threshold_attack(members, non_members, 1e-3)
    assert roc.fpr_resolution == 0.1 and roc.tpr_at_fpr == 0.5


def test_membership_statistics_refuse_empty_or_nan_scores():
    with pytest.raises(ValueError, match="non-empty"):
        roc_auc([], [1.0])
    with pytest.raises(ValueError, match="finite"):
        threshold_attack([float("nan")], [1.0])
