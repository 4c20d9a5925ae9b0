"""``sparta-tune`` (issue 51): every kind of method tunes through the CLI; the dry run shows the price of tuning
and writes nothing; a tuning killed with SIGKILL resumes with the same candidates and never under-counts;
the tuning section's mistakes are one line."""

import json
import math
import os
import signal
import time

import pytest

from sparta_tf.methods import METHODS
from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.privacy.tuning import CandidateCount, per_run_event, tuning_epsilon
from sparta_tf.tuning import procedure
from small_configs import set_key, tiny_config
from small_runs import sparta_tune, start_sparta_tune, wait_mid_epoch_after
from trainers import cli, tune, tune_cli
from trainers.config import ConfigError, validate

OPTIONS = {"x_bitfit": {"full_epochs": 1}}


def tuning_config(out, method="sparta", epochs=3, mean=1.5, seed=0, **training) -> dict:
    """:func:`tiny_config` with a learning-rate tuning (seed 0 at mean 1.5: one candidate; mean 2: two)."""
    config = tiny_config(out, method, epochs=epochs, **training)
    config["method"].update(OPTIONS.get(method, {}))
    config["tuning"] = {"space": {"training.learning_rate": [0.03, 0.1]}, "mean": mean, "seed": seed}
    return config


# The methods whose tuning differs through the CLI: a selection epoch and the export (sparta), two phases
# (x_bitfit), mechanisms before training (dp_frost, dp_ssgd's pre-pruning), a non-private run (oracle).
# Every method tunes through tune_privately (test_tuning_library) and trains through sparta-train (test_cli_run).
CLI_TUNED = ("dp_frost", "dp_ssgd", "oracle", "sparta", "x_bitfit")


def test_the_cli_tuned_methods_are_methods():
    assert set(CLI_TUNED) <= set(METHODS)


@pytest.mark.parametrize("method", CLI_TUNED)
def test_every_kind_of_method_tunes_through_the_cli(method, tmp_path):
    config = tuning_config(tmp_path / "t", method)
    config["export"] = {"enabled": method == "sparta"}  # the export's copy, once (seconds a method)
    results = tune.tune(validate(config))
    out = tmp_path / "t"
    assert results["released"] and results["hyperparameters"]["training.learning_rate"] in (0.03, 0.1)
    ledger = PrivacyLedger.load(out / "release" / "ledger.json")
    assert ledger.tuning == CandidateCount(1.5, "geometric")
    assert (out / "release" / "model.keras").exists() and (out / "release" / "export").is_dir() == (method == "sparta")
    if method == "sparta":  # a fixed version, not the winner's own export number
        assert os.listdir(out / "release" / "export") == ["1"]
    released = json.loads((out / "release" / "results.json").read_text())
    assert "candidates" not in released and tune.CANDIDATES + os.sep not in json.dumps(released)  # not K, no index
    assert json.loads((out / "results.json").read_text())["not_released"]["candidates"] == 1  # the private side
    if method == "oracle":
        assert not results["private"] and results["epsilon"] is None
        return
    assert results["epsilon"] <= 8.0 * (1 + 1e-9) and results["epsilon"] == ledger.epsilon()


# The dry runs call sparta-tune's and sparta-train's entry points in this process (the same code as a fresh
# one; the kill test below runs sparta-tune in fresh processes).
def test_the_dry_run_prints_the_price_of_tuning_and_writes_nothing(tmp_path, write_config, capsys):
    out = tmp_path / "dry"
    assert tune_cli.main(["--config", str(write_config(tuning_config(out, mean=4))), "--dry-run"]) == 0
    stdout = capsys.readouterr().out
    for text in ("private tuning: release the best of a geometric number of candidate runs, mean 4",
                 "each candidate: epsilon", "whole tuning: epsilon", "price of tuning: one untuned run at epsilon 8",
                 "x its noise", "noise multiplier sigma ="):
        assert text in stdout, stdout
    assert not out.exists()


def test_a_tuning_that_leaves_nothing_to_learn_is_refused_in_one_line(tmp_path, write_config, capsys):
    config = set_key(tuning_config(tmp_path / "t", mean=50), "privacy.target_epsilon", 0.02)
    status = tune_cli.main(["--config", str(write_config(config)), "--dry-run"])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.startswith("config error")]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("config error: tuning: "), stderr
    assert "no candidate can learn" in lines[0] or "no per-run noise meets target_epsilon=0.02" in lines[0]


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_multi_worker_tuning_is_refused_in_one_line_before_anything_runs(tmp_path, write_config, capsys, dry_run):
    """Each worker would draw its own candidates, seeds and data split."""
    out = tmp_path / "t"
    config = tuning_config(out, strategy="multi_worker")
    status = tune_cli.main(["--config", str(write_config(config)), *(["--dry-run"] if dry_run else [])])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("config error")]
    assert status == 2 and len(lines) == 1 and "multi_worker is not supported by sparta-tune" in lines[0]
    assert not out.exists()


def test_sigkill_mid_candidate_then_resume_keeps_the_draws_and_never_undercounts(tmp_path, write_config):
    out = tmp_path / "killed"
    path = write_config(tuning_config(out, epochs=3, mean=2, seed=0, batch_size=12))
    process = start_sparta_tune(path)
    second = out / "candidates" / "001"
    try:
        assert wait_mid_epoch_after(second, 2, time.time() + 400), "the second candidate did not get going in time"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not (out / "results.json").exists()
    state_before = (out / "tuning.json").read_text()
    first_results = (out / "candidates" / "000" / "results.json").stat().st_mtime_ns
    fresh = sparta_tune(path, timeout=300)
    assert fresh.returncode == 2 and "holds an interrupted tuning" in fresh.stderr, fresh.stderr[-1000:]

    result = sparta_tune(path, "--resume", timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (out / "tuning.json").read_text() == state_before  # the same K, values and seeds: nothing drawn again
    assert (out / "candidates" / "000" / "results.json").stat().st_mtime_ns == first_results  # not run again
    state = json.loads(state_before)
    count = CandidateCount.from_dict(state["draws"]["count"])
    released = PrivacyLedger.load(out / "release" / "ledger.json")
    killed = PrivacyLedger.load(second / "ledger.json")
    assert any(entry.phase == "interrupted" for entry in killed.entries)  # the killed steps stay charged
    for index in range(len(state["draws"]["candidates"])):
        candidate = PrivacyLedger.load(out / "candidates" / f"{index:03d}" / "ledger.json")
        mine, theirs = procedure.plan_signature(candidate.entries), procedure.plan_signature(released.entries)
        assert all(theirs.get(key, 0) >= count_ for key, count_ in mine.items())
        training = [e for e in candidate.entries if e.kind != "tuning_score"]
        assert released.epsilon() >= tuning_epsilon(per_run_event(training, state["score_noise"]), count,
                                                    released.delta) - 1e-12
    assert released.epsilon() <= 8.0 * (1 + 1e-9)
    results = json.loads((out / "release" / "results.json").read_text())
    assert results["released"] and results["epsilon"] == released.epsilon()


@pytest.mark.parametrize("key, value, message", [
    ("tuning.space", {"training.epochs": [2, 3]}, "tuning.space.training.epochs changes the number of steps"),
    ("tuning.space", {"privacy.target_epsilon": [2, 8]}, "changes the budget"),
    ("tuning.space", {"training.nope": [1]}, "training has no key 'nope'"),
    ("tuning.space", {"learning_rate": [1]}, "name a key as section.key"),
    ("tuning.space", {"training.learning_rate": [-1.0]}, "is not a valid config"),
    ("tuning.space", None, "tuning.space is required"),
    ("tuning.mean", 0.5, "tuning.mean=0.5 must be a number >= 1"),
    ("tuning.shape", "binomial", "tuning.shape='binomial'"),
    ("tuning.score_noise", 0, "tuning.score_noise=0 must be > 0"),
    ("tuning.extra", 1, "unknown key tuning.extra"),
    ("privacy.noise_multiplier", 1.0, "privacy.noise_multiplier is set"),
])
def test_tuning_section_mistakes_are_one_line(tmp_path, key, value, message):
    with pytest.raises(ConfigError) as error:
        validate(set_key(tuning_config(tmp_path), key, value))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_sparta_tune_needs_a_tuning_section_and_sparta_train_notes_it(tmp_path, write_config, capsys):
    assert tune_cli.main(["--config", str(write_config(tiny_config(tmp_path / "a"))), "--dry-run"]) == 2
    assert "the config has no tuning section" in capsys.readouterr().err
    noted = write_config(tuning_config(tmp_path / "b", epochs=1, method="bitfit"))
    assert cli.main(["--config", str(noted), "--dry-run"]) == 0
    assert "the tuning section is sparta-tune's" in capsys.readouterr().err


def test_a_space_key_that_changes_the_mechanism_of_some_candidates_is_refused(tmp_path, capsys):
    config = tuning_config(tmp_path / "t", "dp_frost")
    config["tuning"]["space"] = {"method.r_eps": [0.5, 0.8]}  # 0.2 leaves the training less than the tuning costs
    with pytest.raises(ConfigError, match="runs other privacy mechanisms"):
        tune.tune(validate(config))
    assert not os.path.exists(tmp_path / "t" / tune.STATE)
    assert math.isfinite(procedure.default_score_noise(100))


def test_a_tuning_with_correlated_noise_releases_its_banded_charges(tmp_path):
    """sparta-tune with privacy.bands: every candidate runs BandMF (its own ledger's entries have 2 bands),
    and the released ledger charges what the analysis sees of them: ceil(T / b) runs at b q."""
    config = tuning_config(tmp_path / "t", "all", epochs=2)
    config["privacy"]["bands"] = 2
    config["export"] = {"enabled": False}
    results = tune.tune(validate(config))
    candidates = sorted((tmp_path / "t").glob(f"{tune.CANDIDATES}/*/ledger.json"))
    assert candidates
    ran = [e for e in PrivacyLedger.load(candidates[0]).entries if e.kind != "tuning_score"]
    assert ran and all(entry.bands == 2 for entry in ran)
    released = [e for e in PrivacyLedger.load(tmp_path / "t" / "release" / "ledger.json").entries
                if e.kind != "tuning_score"]
    assert [e.sample_rate for e in released] == [ran[0].sample_rate]  # b q, the group's rate
    assert sum(e.compositions for e in released) == sum(e.compositions for e in ran) < sum(e.count for e in ran)
    assert results["epsilon"] <= 8.0 * (1 + 1e-9)


def test_the_score_noise_and_denominator_come_from_public_sizes_not_the_validation_splits(tmp_path, monkeypatch):
    """The validation split's size follows from which examples the split held out; the released ledger's score
    entry (its noise) and the released score must not reveal it: both use E[n_val] from n_train and
    val_fraction. One example more in validation (n_val + 1, n_train - 1... here: n_val alone changed) leaves
    the noise as it was."""
    config = validate(tuning_config(tmp_path / "t", "bitfit", epochs=2))
    setup = tune.Setup(config)
    n_train, fraction = len(setup.dataset.y_train), config["data"]["val_fraction"]
    public = procedure.expected_validation_units(n_train, fraction)
    assert setup.public_validation_size == public == round(n_train * fraction / (1 - fraction))
    assert setup.repetition.score_noise == pytest.approx(math.sqrt(public) / 2)
    from trainers import run
    loaded = run.load_private_data

    def one_more_in_validation(*args, **kwargs):
        dataset = loaded(*args, **kwargs)
        dataset.x_val, dataset.y_val = dataset.x_val[:-1], dataset.y_val[:-1]  # n_val moves, n_train does not
        return dataset

    monkeypatch.setattr(run, "load_private_data", one_more_in_validation)
    other = tune.Setup(config)
    assert other.validation_size == setup.validation_size - 1
    assert other.repetition.score_noise == setup.repetition.score_noise
    assert other.plan.noise_multiplier == setup.plan.noise_multiplier
    draws = procedure.Draws.draw(CandidateCount(1.5, "geometric"), {"x": [1]}, 0)

    class Model:
        def __init__(self, model):
            self.model, self.ledger = model, PrivacyLedger(1e-5)

    score = procedure.score_candidate(Model(setup.model), setup.dataset.x_val, setup.dataset.y_val, draws, 0, 1.0,
                                      denominator=public)
    correct = procedure.count_correct(setup.model, setup.dataset.x_val, setup.dataset.y_val)
    assert score == pytest.approx((correct + draws.score_noise(0, 1.0)) / public)


def test_the_release_states_a_split_key_that_training_seed_decides_and_an_old_tunings_validation_size(tmp_path):
    """The candidates' run seeds are secret, so no run's seed caveat says that ``training.seed`` decides which
    examples were held out; and a tuning started before the denominator was public released ``n_val``."""
    from sparta_tf.data.loader import KNOWN_KEY_CAVEAT

    known = KNOWN_KEY_CAVEAT.format(where="derived from training.seed")
    config = tuning_config(tmp_path / "t")
    set_key(config, "training.seed", 3)
    seeded = validate(config)
    set_key(config, "training.seed", None)
    secret = validate(config)
    public_denominator = {"score_denominator": 90}
    assert tune.release_caveats(seeded, public_denominator) == [known]
    assert tune.release_caveats(secret, public_denominator) == []
    assert tune.release_caveats(secret, {"validation_size": 88}) == [procedure.VALIDATION_SIZE_CAVEAT]


def test_a_secret_tunings_candidate_runs_its_public_streams_apart_from_its_secret_seed(tmp_path):
    """``sparta-train`` gets each candidate's public seed from the hooks: with a secret tuning seed one of its
    own (a random mask of the released winner tells nothing of the run seed), with a given one the run seed."""
    space = {"learning_rate": [0.1, 0.5]}
    for given, same in ((None, False), (5, True)):
        draws = procedure.Draws.draw(CandidateCount(2.0, 1.0), space, given)
        hooks = tune.CandidateHooks(0, draws, None, str(tmp_path), None, None)
        assert (hooks.public_seed == hooks.run_seed) is same


def test_a_diverged_candidates_charges_count_in_the_release(tmp_path, monkeypatch):
    """A candidate that diverged ranks last, but what it ran (its ledger.json, which the step journal charged:
    e.g. steps a kill made it repeat) still bounds the released ledger."""
    import dataclasses

    from sparta_tf import checkpointing
    from sparta_tf.privacy.ledger import LedgerEntry

    def diverged(config, state, draws, index, candidate_dir):
        ledger = PrivacyLedger(config["privacy"]["delta"])
        for entry in state["planned_entries"]:
            planned = LedgerEntry.from_dict(entry)
            ledger.charge(dataclasses.replace(planned, count=2 * planned.count))
        os.makedirs(candidate_dir, exist_ok=True)
        ledger.save(os.path.join(candidate_dir, checkpointing.LEDGER))
        return None

    monkeypatch.setattr(tune, "_candidate", diverged)
    config = tuning_config(tmp_path / "t")
    config["export"] = {"enabled": False}
    results = tune.tune(validate(config))
    planned = sum(e["count"] for e in json.loads((tmp_path / "t" / "tuning.json").read_text())["planned_entries"])
    released = PrivacyLedger.load(tmp_path / "t" / "release" / "ledger.json")
    assert not results["released"] and released.steps == 2 * planned
