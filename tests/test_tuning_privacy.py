"""Private tuning's privacy (issue 51): the procedure's epsilon against dp-accounting directly, the
calibration within the target, the number of candidates following its distribution, the released ledger
dominating every candidate, and the secret draws coming from their own streams."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from sparta_tf import random_streams
from sparta_tf.method_spec import Phase
from sparta_tf.privacy import accounting
from sparta_tf.privacy.ledger import LedgerEntry, PrivacyLedger
from sparta_tf.privacy.plan import make_privacy_plan
from sparta_tf.privacy.tuning import (CandidateCount, Repetition, TuningBudgetError, per_run_event, per_run_signal,
                                      tuning_epsilon)
from sparta_tf.tuning import procedure
from sparta_tf.tuning.space import check_space, corners, draw

SHAPES = [0.0, 0.5, 1.0, math.inf]


def direct_epsilon(sigma, q, steps, score_noise, mean, shape, delta):
    """dp-accounting alone: RDP of RepeatAndSelect(training o score)."""
    inner = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
                                          steps),
        dp_accounting.GaussianDpEvent(score_noise)])
    event = dp_accounting.dp_event.RepeatAndSelectDpEvent(inner, mean, shape)
    return rdp_privacy_accountant.RdpAccountant().compose(event).get_epsilon(delta)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_procedures_epsilon_is_dp_accountings(shape):
    entries = [LedgerEntry(1.1, 0.05, 300, "dp_sgd_step", "warmup"),
               LedgerEntry(1.1, 0.05, 100, "dp_sgd_step", "sparse")]
    count = CandidateCount(4.0, shape)
    ours = tuning_epsilon(per_run_event(entries, 12.0), count, 1e-5)
    assert ours == pytest.approx(direct_epsilon(1.1, 0.05, 400, 12.0, 4.0, shape, 1e-5), rel=1e-9)
    untuned = accounting.compute_epsilon(1.1, 0.05, 400, 1e-5, "rdp")
    assert ours > untuned  # tuning costs something


def test_a_ledger_recording_a_tuning_reports_the_procedures_epsilon_and_round_trips():
    ledger = PrivacyLedger(1e-5, target_epsilon=8.0)
    ledger.record(1.1, 0.05, 400)
    ledger.charge(procedure.score_entry(12.0))
    ledger.record_tuning(CandidateCount(4.0, 1.0))
    assert ledger.accountant == "rdp"
    assert ledger.epsilon() == pytest.approx(direct_epsilon(1.1, 0.05, 400, 12.0, 4.0, 1.0, 1e-5), rel=1e-9)
    again = PrivacyLedger.from_json(ledger.to_json())
    assert again.epsilon() == ledger.epsilon() and again.tuning == ledger.tuning
    assert "RepeatAndSelectDpEvent" in ledger.report() and "number of candidates" in ledger.report()
    with pytest.raises(ValueError, match="already records a tuning"):
        ledger.record_tuning(CandidateCount(2.0))


@pytest.mark.parametrize("shape", [0.0, 1.0, math.inf])
@pytest.mark.parametrize("target", [2.0, 8.0])
def test_the_plan_calibrates_a_candidates_noise_so_the_whole_tuning_meets_the_target(shape, target):
    """The tuned plan's sigma: dp-accounting puts the tuning within the target, and 1% less noise over it."""
    q, steps, noise, delta = 0.05, 400, 11.8, 1e-5
    repetition = Repetition(CandidateCount(3.0, shape), noise)
    phases = [Phase("warmup", epochs=4, updates=True), Phase("sparse", epochs=16, updates=True)]
    plan = make_privacy_plan(n=5000, expected_batch_size=250, phases=phases, delta=delta, target_epsilon=target,
                             tuning=repetition)
    sigma = plan.noise_multiplier
    assert plan.accountant == "rdp" and plan.steps == steps and plan.run_budget == plan.epsilon < target
    assert direct_epsilon(sigma, q, steps, noise, 3.0, shape, delta) <= target * (1 + 1e-9)
    assert direct_epsilon(sigma * 0.99, q, steps, noise, 3.0, shape, delta) > target
    assert plan.tuned_epsilon == pytest.approx(direct_epsilon(sigma, q, steps, noise, 3.0, shape, delta), rel=1e-9)
    untuned = make_privacy_plan(n=5000, expected_batch_size=250, phases=phases, delta=delta, target_epsilon=target,
                                accountant="rdp")
    assert untuned.noise_multiplier < sigma  # the price of tuning


def test_a_target_no_noise_meets_is_refused_in_one_line():
    repetition = Repetition(CandidateCount(1000.0, math.inf), 50.0)
    phases = [Phase("all", epochs=2, updates=True)]
    with pytest.raises(TuningBudgetError, match="no per-run noise meets target_epsilon=0.05") as error:
        procedure.tuned_plan(lambda tuning: make_privacy_plan(n=1000, expected_batch_size=100, phases=phases,
                                                              delta=1e-5, target_epsilon=0.05, tuning=tuning),
                             repetition, 0.05, 1e-5)
    assert repetition.floor(1e-5) >= 0.05
    assert "\n" not in str(error.value)


def test_the_signal_threshold():
    assert per_run_signal(2.0, 100, 400) == pytest.approx(1000.0)
    assert per_run_signal(400.0, 10, 100) < 1.0

    class Plan:  # the attributes check_signal reads
        noise_multiplier, sample_rate, n, steps = 1000.0, 0.01, 1000, 100

    with pytest.raises(TuningBudgetError, match="no candidate can learn"):
        procedure.check_signal(Plan())


@pytest.mark.parametrize("shape", SHAPES)
def test_the_number_of_candidates_follows_its_distribution(shape):
    """Chi-square goodness of fit of 4,000 draws (fixed seed) against the pmf; the mean within 4
    standard errors; gamma at least dp-accounting's (its analysis bounds what is sampled)."""
    count = CandidateCount(4.0, shape)
    rng = random_streams.numpy_rng(123, "tuning_count")
    draws = np.array([count.sample(rng) for _ in range(4000)])
    assert abs(draws.mean() - 4.0) < 4 * draws.std() / math.sqrt(len(draws))
    support = np.arange(0, 12)
    expected = count.pmf(support) * len(draws)
    observed = np.array([np.sum(draws == k) for k in support])
    tail_expected = len(draws) - expected.sum()
    keep = expected > 5
    observed_bins = np.r_[observed[keep], len(draws) - observed[keep].sum()]
    expected_bins = np.r_[expected[keep], len(draws) - expected[keep].sum()]
    assert tail_expected >= 0
    assert stats.chisquare(observed_bins, expected_bins).pvalue > 1e-3
    assert count.pmf(np.arange(0, 2000)).sum() == pytest.approx(1.0, abs=1e-6)
    if shape != math.inf:
        assert count.gamma >= rdp_privacy_accountant._gamma_truncated_negative_binomial(shape, 4.0)
    if shape != math.inf:
        assert (draws >= 1).all()


def test_a_geometric_count_of_mean_one_is_one_run():
    """gamma = 1: numpy's negative binomial then always draws 0, which the rejection loop used to retry forever."""
    count = CandidateCount(1.0, "geometric")
    rng = np.random.default_rng(0)
    assert {count.sample(rng) for _ in range(20)} == {1}
    assert count.pmf(np.array([1]))[0] == pytest.approx(1.0)


def test_candidate_count_refuses_bad_parameters_in_one_line():
    for mean, shape in [(0.5, 1.0), (float("nan"), 1.0), (3.0, -1.0), (3.0, "binomial")]:
        with pytest.raises(ValueError) as error:
            CandidateCount(mean, shape)
        assert "\n" not in str(error.value)


def test_the_draws_come_from_the_tunings_own_streams_and_never_change_for_one_seed():
    space = check_space({"learning_rate": [0.01, 0.1, 1.0], "clip_norm": {"log_uniform": [0.1, 10.0]}})
    count = CandidateCount(5.0, 1.0)
    first, again = procedure.Draws.draw(count, space, 7), procedure.Draws.draw(count, space, 7)
    assert first == again and procedure.Draws.from_json(first.to_json()) == first
    assert len(first.candidates) == count.sample(random_streams.numpy_rng(7, "tuning_count"))
    assert len({c.run_seed for c in first.candidates}) == len(first.candidates)  # independent runs
    secret = procedure.Draws.draw(count, space)
    assert not secret.seed_given and first.seed_given
    for stream in ("tuning_count", "tuning_candidates", "tuning_runs", "tuning_score_noise"):
        assert random_streams.stream(stream).secret
    noises = [first.score_noise(i, 10.0) for i in range(len(first.candidates))]
    assert noises == [first.score_noise(i, 10.0) for i in range(len(first.candidates))]  # scoring again: same
    # a candidate's public streams (its random mask, readable off the released winner) never use its secret
    # run seed: a secret tuning draws them a seed of their own; a given tuning seed reproduces them
    public = [secret.public_seed(i) for i in range(len(secret.candidates))]
    assert not set(public) & {c.run_seed for c in secret.candidates} and len(set(public)) == len(public)
    assert [first.public_seed(i) for i in range(len(first.candidates))] == [c.run_seed for c in first.candidates]


def test_a_secret_tunings_released_values_are_no_test_of_its_seed():
    """The winner's values are released; with a secret tuning seed they are drawn from a second seed, so
    they are not the tuning seed's ``tuning_candidates`` draws (which would let anyone test guesses of the
    seed behind K, the run seeds and the score noise). A given seed still reproduces them."""
    space = check_space({"learning_rate": {"log_uniform": [0.01, 1.0]}})
    count = CandidateCount(3.0, 1.0)
    secret = procedure.Draws.draw(count, space)
    rng = random_streams.numpy_rng(secret.seed, "tuning_candidates")
    from_seed = [draw(space, rng) for _ in secret.candidates]
    assert all(c.values != v for c, v in zip(secret.candidates, from_seed))
    seeded = procedure.Draws.draw(count, space, 7)
    rng = random_streams.numpy_rng(7, "tuning_candidates")
    assert [c.values for c in seeded.candidates] == [draw(space, rng) for _ in seeded.candidates]


def test_the_space_draws_each_value_with_its_law_and_refuses_bad_entries():
    space = check_space({"lr": [0.01, 0.1], "clip": {"log_uniform": [0.1, 10.0]}, "m": {"uniform": [0.5, 0.9]}})
    rng = np.random.default_rng(0)
    values = [draw(space, rng) for _ in range(2000)]
    assert {v["lr"] for v in values} == {0.01, 0.1}
    assert abs(np.mean([v["lr"] == 0.1 for v in values]) - 0.5) < 0.05
    logs = np.log10([v["clip"] for v in values])
    assert logs.min() >= -1 and logs.max() <= 1 and abs(np.median(logs)) < 0.1
    assert all(0.5 <= v["m"] <= 0.9 for v in values)
    assert len(corners(space)) == 8
    points = check_space([{"lr": 0.1, "head": 1.0}, {"lr": 0.3, "head": 3.0}])
    assert {draw(points, rng)["head"] for _ in range(50)} == {1.0, 3.0}
    for bad in [{}, {"lr": []}, {"lr": {"log_uniform": [0, 1]}}, {"lr": {"uniform": [2, 1]}}, {"lr": 0.1},
                [{"lr": 0.1}, {"momentum": 0.9}]]:
        with pytest.raises(ValueError):
            check_space(bad)


def test_the_released_ledger_dominates_every_candidate_including_one_that_ran_more():
    sparse = LedgerEntry(1.2, 0.05, 320, "dp_sgd_step", "sparse")
    planned = [LedgerEntry(1.2, 0.05, 80, "dp_sgd_step", "warmup"), sparse, procedure.score_entry(12.0)]
    resumed = [LedgerEntry(1.2, 0.05, 85, "dp_sgd_step", "warmup"), sparse, procedure.score_entry(12.0)]
    count = CandidateCount(3.0, 1.0)
    ledger = procedure.released_ledger([planned, planned[:1], resumed], count=count, delta=1e-5, target_epsilon=8.0)
    for candidate in (planned, resumed):
        assert ledger.epsilon() >= tuning_epsilon(per_run_event(candidate[:-1], 12.0), count, 1e-5)
    assert procedure.plan_signature(ledger.entries) == {(1.2, 0.05): 405, (12.0, 1.0): 1}
    assert ledger.epsilon() > tuning_epsilon(per_run_event(planned[:-1], 12.0), count, 1e-5)


def test_the_released_labels_are_the_plans_whatever_the_other_candidates_ran():
    """A space over phase lengths (warm-up 0 or 5 epochs at one sigma and q) and a candidate killed and
    resumed (an ``interrupted`` charge) must not show in the release's labels: they would tell that
    candidates other than the winner ran."""
    score = procedure.score_entry(12.0)
    planned = [LedgerEntry(1.2, 0.05, 20, "sparta_selection", "selection"),
               LedgerEntry(1.2, 0.05, 380, "dp_sgd_step", "sparse"), score]
    longer_warmup = [LedgerEntry(1.2, 0.05, 100, "dp_sgd_step", "warmup"),
                     LedgerEntry(1.2, 0.05, 20, "sparta_selection", "selection"),
                     LedgerEntry(1.2, 0.05, 280, "dp_sgd_step", "sparse"), score]
    interrupted = planned + [LedgerEntry(1.2, 0.05, 3, "dp_sgd_step", "interrupted")]
    count = CandidateCount(3.0, 1.0)

    def labels(*candidates):
        ledger = procedure.released_ledger([planned, *candidates], count=count, delta=1e-5, target_epsilon=8.0)
        return [(e.kind, e.phase) for e in ledger.entries]

    alone = labels(planned)
    assert alone == [("sparta_selection", "selection+sparse"), (score.kind, "tuning")]
    assert labels(planned, longer_warmup) == labels(planned, interrupted) == alone


def test_the_best_is_the_highest_noisy_score_first_among_equals():
    assert procedure.best_index([0.5, 0.7, 0.7, None]) == 1
    assert procedure.best_index([None, float("nan")]) is None
    assert procedure.best_index([]) is None


def test_a_budget_share_below_the_tunings_own_cost_is_refused_in_one_line():
    """DP-FROST's training gets r_eps of the target; when the tuning around the run costs more than that share
    alone, the calibration says so (it used to search up to a noise where dp-accounting's RDP fails)."""
    from sparta_tf.methods import make_method
    from sparta_tf.private_training import plan_method

    with pytest.raises(ValueError) as error:
        plan_method(make_method("dp_frost", r_eps=0.2), dataset_size=115, batch_size=32, epochs=3, delta=1e-3,
                    target_epsilon=8.0, tuning=Repetition(CandidateCount(1.5), 1.8))
    assert str(error.value).startswith("the tuning around the run alone spends epsilon=")
    assert "\n" not in str(error.value)
