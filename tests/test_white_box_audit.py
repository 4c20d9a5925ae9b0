"""The white-box audit (issue 64): gradient canaries inside the DP step.

* a canary is a participant of the run's own sampler (included ones at the sampler's rate, excluded
  ones never), clipped by the step's ``clipped_sum`` called on the canary gradients (a 2C gradient adds
  exactly C), added before the noise on reserved coordinates where the data add nothing;
* the checks, scores and yardstick take sigma and q from what the ledger charged, and a verdict's bounds
  and checks share its confidence;
* a seeded run's seed is neither the default canary seed nor shown;
* without canaries the step is unchanged (bit-identical weights);
* honest runs never exceed their claim (DP-SGD at epsilon 1, 2, 4, 8; BandMF) and their measured
  noise and rate match the ledger;
* three subtly broken mechanisms, the ledger still claiming epsilon 1, are caught by the white box:
  the noise at half its std, the sampler at twice its rate, BandMF without unit column norm (the
  mechanism checks; the one-run bound's values are reported, see docs/audit.md for its reach);
* the scores and checks against direct computations;
* every kind of method is audited (DP-FROST on a variable its mask trains); a variable no step trains is
  refused in one line;
* ``sparta-audit --white-box`` audits SPARTA through the CLI and exits 3 on a mechanism that does not
  match its ledger.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from broken_mechanism import subtly_broken_mechanism
from small_configs import ONE_METHOD_OF_EACH_KIND, tiny_config
from small_models import LOSS, small_data
from sparta_tf.audit import white_box
from sparta_tf.audit.gradient_canaries import GradientCanaries
from sparta_tf.audit.white_box_run import audit_white_box, charged_mechanism, whitening_factor
from sparta_tf.masks import MASK_CHARGE_PREFIX
from sparta_tf.privacy.ledger import INTERRUPTED, PrivacyLedger
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.privacy.sampling import PoissonSampler
from sparta_tf.trainable import TrainableSet
from trainers import audit

N, CANARIES = 512, 2000


def _model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                tf.keras.layers.Dense(64, name="d2"), tf.keras.layers.Dense(64, name="head")])


def _audit(epsilon, bands=1, epochs=2, batch=128, **kwargs):
    x, y = small_data(N)
    dp = sparta_tf.make_private(_model(), method="all", target_epsilon=epsilon, delta=1e-5, epochs=epochs,
                                batch_size=batch, dataset_size=N, seed=1, bands=bands)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    return audit_white_box(dp, x, y, canaries=CANARIES, verbose=0, **kwargs)


@pytest.mark.parametrize("epsilon", [1.0, 2.0, 4.0, 8.0])
def test_an_honest_dp_sgd_run_stays_below_its_claim_and_matches_its_ledger(epsilon):
    report = _audit(epsilon)
    assert report.observed_steps == 8 and set(report.bounds) == {"steps", "final_model"}
    assert not report.contradicts_claim and report.mismatches == []
    assert 0 < report.best.epsilon_lower_bound <= epsilon
    assert report.claimed_epsilon == pytest.approx(epsilon, rel=1e-4)
    assert report.expected.trials == 20 and 0 <= report.expected.mean <= epsilon  # the exact mechanism's, simulated


def test_an_honest_bandmf_run_stays_below_its_claim_and_matches_its_factorization():
    report = _audit(2.0, bands=2, epochs=4)
    assert set(report.bounds) == {"prefix_sum", "final_model"}
    assert not report.contradicts_claim and report.mismatches == []
    assert report.expected is None  # the simulation is of independent noise


@pytest.mark.parametrize("sabotage, bands, caught", [
    ({"noise_scale": 0.5}, 1, "noise_std"),
    ({"rate_scale": 2.0}, 1, "sample_rate"),
    ({"unnormalised_bands": True}, 4, "noise_std"),
])
def test_a_subtly_broken_mechanism_claiming_epsilon_1_is_caught(sabotage, bands, caught):
    with subtly_broken_mechanism(**sabotage):
        report = _audit(1.0, bands=bands, epochs=4 if bands > 1 else 2)
    assert report.claimed_epsilon == pytest.approx(1.0, rel=1e-4)
    assert caught in report.mismatches
    assert report.to_json()["checks"][caught]["matches"] is False


def test_the_checks_hold_the_mechanism_to_what_its_ledger_charged(monkeypatch):
    """Regression: the claimed sigma C and q came from ``dp.mechanism``, the object the DP step reads its noise
    from, so a mechanism drawing half the noise its ledger charges passed as long as it said so itself."""
    monkeypatch.setattr(DpSgdMechanism, "noise_std",
                        property(lambda self: 0.5 * self.noise_multiplier * self.clip_norm))  # the ledger: sigma
    report = _audit(1.0)
    assert report.claimed_epsilon == pytest.approx(1.0, rel=1e-4)
    assert "noise_std" in report.mismatches
    check = report.checks["noise_std"]
    assert check.estimate == pytest.approx(0.5 * check.claimed, rel=0.05)  # claimed: the ledger's sigma times C


def test_the_charged_mechanism_is_read_off_the_ledgers_step_charges():
    ledger = PrivacyLedger(1e-5)
    ledger.record(0.8, 1.0, 1, kind="dp_snip", phase="pre-pruning")  # not a DP step
    ledger.record(1.0, 0.2, 6, phase=MASK_CHARGE_PREFIX + "runs/other")  # a loaded mask's cost: not a DP step
    ledger.record(1.5, 0.1, 3, phase="warmup")  # steps 0-2
    ledger.record(2.0, 0.1, 5, phase="sparse")  # steps 3-7
    ledger.record(2.0, 0.1, 4, phase=INTERRUPTED)  # a killed run's steps charged again: no step of this model
    assert charged_mechanism(ledger, [0, 2], 8).noise_multiplier == 1.5
    charged = charged_mechanism(ledger, [3, 7], 8)
    assert (charged.noise_multiplier, charged.sample_rate, charged.bands) == (2.0, 0.1, 1)
    # dp_step 10 (steps 0-1 of an interrupted run, before its first checkpoint): the charges kept are steps 2-9
    assert [charged_mechanism(ledger, [t], 10).noise_multiplier for t in (4, 5)] == [1.5, 2.0]
    with pytest.raises(ValueError, match="the ledger charges DP steps 2 to 9, not step 1"):
        charged_mechanism(ledger, [1, 4], 10)
    with pytest.raises(ValueError, match="different"):
        charged_mechanism(ledger, [2, 3], 8)
    with pytest.raises(ValueError, match="the ledger charges DP steps 0 to 7, not step 8"):
        charged_mechanism(ledger, [8], 8)
    with pytest.raises(ValueError, match="no gradient step trained a canary's coordinate"):
        charged_mechanism(ledger, [], 8)


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.999])
@pytest.mark.parametrize("bounds", [1, 2, 3])
def test_the_verdict_splits_its_confidence_among_its_bounds_and_checks(confidence, bounds):
    levels = white_box.verdict_levels(confidence, bounds)
    assert len(levels.significances) == bounds + len(white_box.CHECKS)
    assert sum(levels.significances) == pytest.approx(1 - confidence, rel=1e-9)
    assert levels.check == pytest.approx(1 - (1 - confidence) * white_box.CHECK_SHARE)
    assert 0 < 1 - levels.bound < 1 - confidence
    assert white_box.verdict_levels(0.95).check == pytest.approx(0.999)  # 99.9% intervals at the default


def test_canaries_take_part_through_the_runs_sampler_and_the_steps_clip():
    model = _model()
    head = model.layers[-1].kernel
    canaries = GradientCanaries(head, 100, seed=3, clip_norm=0.5)
    sampler = PoissonSampler(N, 0.25, seed=4, extra=canaries.participants)
    canaries.bind_sampler(sampler)
    selections = list(TrainableSet.of_variables(model.trainable_variables))
    sums = [tf.ones(s.compact_shape) for s in selections]  # the data's clipped sum: 1 everywhere
    rates = []
    for step in range(40):
        out = canaries.insert(sums, step, selections)
        head_sum = out[-2].numpy().ravel()  # the head kernel (then its bias)
        on_canaries = head_sum[canaries.coordinates]
        assert np.all((on_canaries == 0) | np.isclose(on_canaries, 0.5))  # 2C clipped to exactly C = 0.5
        assert not np.any(on_canaries[~canaries.included])  # excluded: never sampled, data zeroed
        others = np.delete(head_sum, canaries.coordinates)
        assert np.all(others == 1)  # the data's sum elsewhere untouched
        expected = sampler.extra_mask(step).numpy()
        np.testing.assert_array_equal(on_canaries[canaries.included] > 0, expected)
        rates.append(expected.mean())
    assert abs(np.mean(rates) - 0.25) < 4 * np.sqrt(0.25 * 0.75 / (40 * canaries.participants))


def test_without_canaries_the_step_is_unchanged():
    x, y = small_data(N)
    weights = []
    for extra in (False, True):
        model = _model()
        dp = sparta_tf.make_private(model, method="all", target_epsilon=2.0, delta=1e-5, epochs=1, batch_size=128,
                                    dataset_size=N, seed=1)
        dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
        if extra:  # a sampler with zero extra participants draws what one without the option draws
            assert np.array_equal(PoissonSampler(N, 0.25, seed=2, extra=0).sample_mask(3).numpy(),
                                  PoissonSampler(N, 0.25, seed=2).sample_mask(3).numpy())
        dp.fit(x, y, verbose=0)
        weights.append([v.numpy() for v in model.weights])
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def test_the_step_score_is_the_poisson_mixture_likelihood_ratio():
    x = np.array([[0.3, -1.0], [2.0, 0.1]])
    q, std, clip = 0.2, 1.5, 1.0
    expected = [sum(np.log(1 - q + q * np.exp((clip * v - clip**2 / 2) / std**2)) for v in x[:, j]) for j in range(2)]
    np.testing.assert_allclose(white_box.step_scores(x, q, std, clip), expected)
    np.testing.assert_allclose(white_box.prefix_sum_scores(x), [2.3, -0.9])
    np.testing.assert_allclose(white_box.final_model_scores([1.0, 1.0], [0.5, 2.0]), [0.5, -1.0])


def test_the_checks_measure_noise_and_rate_and_whitening_undoes_the_factorization():
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 2.0, (50, 400))
    assert white_box.noise_interval(noise, 2.0, 0.999).matches and not white_box.noise_interval(noise, 2.4, 0.999).matches
    sampled = rng.random((400, 200)) < 0.1
    rate = white_box.rate_interval(sampled * 1.0 + rng.normal(0, 0.5, (400, 200)), 1.0, 0.5, 0.1, 0.999)
    assert rate.matches and abs(rate.estimate - 0.1) < 0.01
    coefficients = np.array([0.8, 0.6])
    steps = [0, 1, 2, 5, 6]  # a gap: steps 3-4 released no gradient
    factor = whitening_factor(coefficients, steps)
    assert factor[1, 0] == 0.6 and factor[3, 2] == 0 and factor[4, 3] == 0.6 and np.allclose(np.diag(factor), 0.8)


def test_sparta_audit_white_box_runs_sparta_and_writes_its_report_with_the_black_box_audit_of_the_same_run(
        tmp_path, write_config, capsys):
    config = tiny_config(tmp_path / "out", method="sparta", epochs=3)
    config["method"]["warmup_epochs"] = 1
    path = write_config(config)
    assert audit.main(["--config", path, "--white-box", "--canaries", "150", "--data-canaries", "40"]) == 0
    report = json.loads((tmp_path / "out" / "audit" / "audit.json").read_text())
    assert report["kind"] == "white_box" and report["passed"] and report["canaries"] == 150
    assert set(report["bounds"]) == {"steps", "final_model"} and report["mismatches"] == []
    assert report["observed_steps"] > 0 and report["steps"] > report["observed_steps"]  # selection: not observed
    assert report["expected_bound"]["trials"] == 20
    black_box = report["black_box"]  # the data canaries of the same run: one training, two audits
    assert black_box["canaries"] == 40 and black_box["passed"] and black_box["test_accuracy"] == report["test_accuracy"]
    assert black_box["n"] == report["n"]  # the data canaries are private training examples of this run
    # one verdict (exit 3) at 95%: the three bounds and the two checks share its 5% (Bonferroni)
    significances = [1 - bound["confidence"] for bound in report["bounds"].values()] + [1 - black_box["confidence"]]
    assert sum(significances) < 0.05  # room left for the checks
    significances += [1 - check["confidence"] for check in report["checks"].values()]
    assert report["confidence"] == 0.95 and sum(significances) == pytest.approx(0.05)
    output = capsys.readouterr().out
    assert "white-box audit of epsilon" in output and "black box (data canaries)" in output


def test_an_audit_of_a_seeded_run_does_not_publish_its_seed(tmp_path, write_config, capsys):
    """Regression: the canary seed defaulted to ``training.seed``, the audit run's DP noise and batch seed, and
    ``audit.json`` and both audits' lines printed it. A drawn canary seed is neither the run's seed nor shown."""
    secret = 918273645
    config = tiny_config(tmp_path / "out", method="all", epochs=1, seed=secret)
    assert audit.main(["--config", write_config(config), "--white-box", "--canaries", "100",
                       "--data-canaries", "40"]) == 0
    written = (tmp_path / "out" / "audit" / "audit.json").read_text()
    output = capsys.readouterr().out
    assert str(secret) not in written and str(secret) not in output
    assert json.loads(written)["black_box"]["canary_seed"] is None and output.count("canary seed drawn, not shown") == 2
    drawn = audit.default_canary_seed(config)
    assert drawn == audit.default_canary_seed(config) != secret  # reproducible from the seeded run, not its seed
    assert audit.seed_line(4321, given=True) == "canary seed 4321"  # --canary-seed: the user's own choice, shown


def test_data_canaries_need_the_white_box_audit(tmp_path, write_config, capsys):
    path = write_config(tiny_config(tmp_path / "out", method="all", epochs=1))
    assert audit.main(["--config", path, "--data-canaries", "40"]) == 2
    assert "--data-canaries adds data canaries to a --white-box audit" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sparta_audit_white_box_exits_3_on_a_mechanism_that_does_not_match_its_ledger(tmp_path, write_config):
    config = tiny_config(tmp_path / "out", method="all", epochs=2)
    with subtly_broken_mechanism(noise_scale=0.5):
        assert audit.main(["--config", write_config(config), "--white-box", "--canaries", "150"]) == 3
    report = json.loads((tmp_path / "out" / "audit" / "audit.json").read_text())
    assert report["mismatches"] == ["noise_std"] and report["passed"] is False


OPTIONS = {"sparta": {"warmup_epochs": 1}, "oracle": {"warmup_epochs": 1}, "x_bitfit": {"full_epochs": 1}}


@pytest.mark.parametrize("method", ONE_METHOD_OF_EACH_KIND)
def test_every_kind_of_method_is_audited_without_contradiction(method):
    x, y = small_data(256)
    model = _model()
    dp = sparta_tf.make_private(model, method=method, target_epsilon=4.0, delta=1e-5, epochs=3, batch_size=64,
                                dataset_size=256, seed=1, **OPTIONS.get(method, {}))
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    variable = model.layers[0].kernel if method == "dp_frost" else None  # DP-FROST's mask here: the first layer
    report = audit_white_box(dp, x, y, canaries=100, variable=variable, verbose=0)
    assert report.observed_steps > 0 and report.mismatches == []
    assert not report.contradicts_claim  # the oracle claims inf: nothing to contradict


def test_a_variable_no_step_trains_is_refused_in_one_line():
    x, y = small_data(256)
    model = _model()
    dp = sparta_tf.make_private(model, method="dp_frost", target_epsilon=4.0, delta=1e-5, epochs=3, batch_size=64,
                                dataset_size=256, seed=1)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    with pytest.raises(ValueError, match="no gradient step trained a canary's coordinate") as error:
        audit_white_box(dp, x, y, canaries=100, variable=model.layers[-1].kernel, verbose=0)
    assert "\n" not in str(error.value)


def test_a_model_running_several_steps_a_call_is_refused_before_its_first_step():
    """Keras calls the recorder once per call of ``steps_per_execution`` steps: it would lose observations."""
    x, y = small_data(N)
    dp = sparta_tf.make_private(_model(), method="all", target_epsilon=2.0, delta=1e-5, epochs=1, batch_size=128,
                                dataset_size=N, seed=1)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS, steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=1") as error:
        audit_white_box(dp, x, y, canaries=100, verbose=0)
    assert "\n" not in str(error.value) and int(dp.dp_step.numpy()) == 0 and dp.ledger.steps == 0
