"""sparta-train end to end on tiny synthetic data: every method, dry run, outputs, SIGKILL + resume."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from sparta_tf.data import load_dataset

from small_configs import ONE_METHOD_OF_EACH_KIND, tiny_config
from small_runs import sparta_train, start_sparta_train, wait_mid_epoch_after
from trainers import cli, pretraining, run
from trainers.config import validate

@pytest.mark.parametrize("method", ONE_METHOD_OF_EACH_KIND)
def test_each_kind_of_method_runs_end_to_end(tmp_path, method):
    config = validate(tiny_config(tmp_path / method, method, export=True))  # as users run it: with the export
    results = run.train(config)
    on_disk = json.loads((tmp_path / method / "results.json").read_text())
    assert on_disk["method"] == method
    assert on_disk["private"] is (method != "oracle")
    steps_per_epoch = round(1 / on_disk["sample_rate"])
    selection_steps = 5 if method == "dp_frost" else 0  # PSEL's T rounds at their own (q_ps, sigma)
    assert on_disk["steps"] == 3 * steps_per_epoch + selection_steps
    if method != "oracle":
        assert on_disk["epsilon"] <= 8.0 + 1e-6
    else:
        assert on_disk["epsilon"] is None
    assert 0 < on_disk["trainable_fraction"] <= 1
    assert on_disk["non_finite_examples"] == 0 == sum(on_disk["history"]["non_finite"])
    for key in ("delta", "noise_multiplier", "epochs", "test_accuracy", "seconds_per_phase"):
        assert key in on_disk
    assert os.path.exists(os.path.join(results["export_dir"], "saved_model.pb"))
    assert (tmp_path / method / "ledger.json").exists()
    assert os.listdir(tmp_path / method / "tensorboard")
    if method == "dp_frost":
        ledger = json.loads((tmp_path / method / "ledger.json").read_text())
        assert any(e.get("phase") == "frost_selection" for e in ledger["entries"])
    if method in ("sparta", "dpsgd_grad", "oracle", "mp", "random", "dp_frost", "dp_ssgd"):
        assert (tmp_path / method / "mask" / "mask.npz").exists()
    _assert_ledger_follows_the_plan(config, tmp_path / method)


def _assert_ledger_follows_the_plan(config, out):
    """The dry run's plan, the run's plan.json and the finished ledger hold the same mechanism runs."""
    ledger = json.loads((out / "ledger.json").read_text())
    planned = json.loads((out / "plan.json").read_text())
    dry = run.dry_run(config, compare_bands=False)
    assert [e.to_dict() for e in dry.events()] == planned["events"] == ledger["entries"]
    # The learning-rate schedule spans the update steps: a selection epoch does not advance it.
    results = json.loads((out / "results.json").read_text())
    assert results["optimizer_steps"] == planned["update_steps"] == dry.update_steps
    assert dry.private == planned["private"] == (not ledger["nonprivate"])


def test_dp_ssgd_with_dp_snip_charges_pre_pruning_within_budget(tmp_path):
    config = tiny_config(tmp_path / "snip", "dp_ssgd")
    config["method"].update({"prune": "dp_snip", "prune_rate": 0.5, "drop_rate": 0.3})
    results = run.train(validate(config))
    ledger = json.loads((tmp_path / "snip" / "ledger.json").read_text())
    assert [e["phase"] for e in ledger["entries"]][0] == "pre-pruning"
    assert 0.98 * 8.0 <= results["epsilon"] <= 8.0 + 1e-6
    assert results["prune"] == "dp_snip"


def test_finished_output_dir_is_not_overwritten(tmp_path):
    config = validate(tiny_config(tmp_path / "run", "bitfit", epochs=1))
    results = run.train(config)
    # seed 0 in the config: the noise follows from it, and the results say so
    assert results["privacy_caveats"] == [run.SEED_CAVEAT]
    with pytest.raises(run.ConfigError, match="already holds a finished run"):
        run.train(config)


def test_a_secret_seed_leaves_no_caveat_and_the_report_says_what_epsilon_covers(tmp_path, capsys):
    config = validate(tiny_config(tmp_path / "run", "bitfit", epochs=1, seed=None))
    results = run.train(config)
    assert results["private"] and results["privacy_caveats"] == []  # a secret split key, too: no caveat
    key = json.loads((tmp_path / "run" / "data_split.json").read_text())["key"]
    from trainers import check_export

    x_test, _ = check_export.raw_test_split(config)  # the run's test split, rebuilt with the run's secret key
    assert len(x_test) == len(load_dataset(config["data"], split_key=key).x_test)
    out = capsys.readouterr().out
    assert "covers" in out and "seed stays secret" in out and "training.seed is set" not in out


def test_the_data_sets_caveats_join_the_seed_caveat_in_private_runs_only(tmp_path):
    """One list feeds the warning at the start and the ledger (hence results.json and the report)."""
    from sparta_tf.data import Dataset

    empty = np.zeros((0, 2, 2, 1), np.float32)
    labels = np.zeros(0, np.int64)
    dataset = Dataset(empty, labels, empty, labels, empty, labels, num_classes=3, class_names=list("abc"),
                      name="toy", class_count_from_private_labels=True)
    config = validate(tiny_config(tmp_path / "run", "bitfit"))
    caveats = run.privacy_caveats(config, dataset, private=True)
    assert caveats[0] == run.SEED_CAVEAT and "number of classes (3) was read off the private labels" in caveats[1]
    assert run.privacy_caveats(config, dataset, private=False) == []
    config["training"]["seed"] = None
    assert run.privacy_caveats(config, dataset, private=True) == caveats[1:]


def test_dry_run_prints_the_plan(tmp_path, write_config, capsys):
    # sparta-train's entry point in this process (a fresh one runs the same code; see the kill tests below)
    assert cli.main(["--config", str(write_config(tiny_config(tmp_path / "dry"))), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for text in ("private training examples n =", "noise multiplier sigma =", "warmup", "selection", "sparse"):
        assert text in out
    assert not (tmp_path / "dry").exists()  # a dry run writes nothing


def test_sigkill_mid_epoch_then_resume_never_undercounts(tmp_path, write_config):
    out = tmp_path / "killed"
    path = write_config(tiny_config(out, "sparta", epochs=3, batch_size=12))
    process = start_sparta_train(path)
    try:
        assert wait_mid_epoch_after(out, 1, time.time() + 240), "no checkpoint in time"  # in the selection epoch
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not (out / "results.json").exists(), "the run finished before it could be killed"
    state_before = sorted(p.name for p in (out / "checkpoints").iterdir())
    journal_before = (out / "checkpoints" / "journal.json").read_text()
    # Regression: a fresh start in the killed run's directory overwrote its journal, so --resume later
    # charged none of the killed run's steps after its checkpoint. A fresh start must be refused.
    fresh = sparta_train(path, timeout=300)
    assert fresh.returncode == 2 and "holds an interrupted run" in fresh.stderr, fresh.stderr[-1000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == state_before
    assert (out / "checkpoints" / "journal.json").read_text() == journal_before
    latest = (out / "checkpoints" / "latest").read_text()
    state = json.loads((out / "checkpoints" / latest / "state.json").read_text())
    started = json.loads((out / "checkpoints" / "journal.json").read_text())["started_through"]
    on_disk = json.loads((out / "ledger.json").read_text())
    assert sum(e["count"] for e in on_disk["entries"]) >= started  # ledger.json charged every started step

    result = sparta_train(path, "--resume", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    ledger = json.loads((out / "ledger.json").read_text())
    per_epoch = round(1 / results["sample_rate"])
    lost = started - state["epoch"] * per_epoch
    assert lost > 0
    phases = {}
    for entry in ledger["entries"]:
        phases[entry.get("phase")] = phases.get(entry.get("phase"), 0) + entry["count"]
    assert phases.get("interrupted", 0) == lost  # steps of the killed epoch stay charged
    assert results["steps"] == sum(phases.values()) >= started  # every step ever started is counted
    assert results["epsilon"] <= 8.0 + 1e-6  # the charged steps may cost the last epoch, never the budget
    assert not [d for d in os.listdir(out / "checkpoints") if d.startswith(".partial-")]
    assert "resuming after epoch" in result.stdout


def test_ctrl_c_mid_run_is_one_line_saying_how_to_resume(tmp_path, write_config):
    """Regression: SIGINT ended the run with a KeyboardInterrupt traceback. It must print one line that
    says the run stopped and how to continue it, exit 130, and --resume must then finish the run."""
    out = tmp_path / "stopped"
    path = write_config(tiny_config(out, "sparta", epochs=3, batch_size=12))
    process = start_sparta_train(path, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal's
    try:
        assert wait_mid_epoch_after(out, 2, time.time() + 240), "no checkpoint in time"  # in the sparse epoch
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not (out / "results.json").exists(), "the run finished before it could be interrupted"
    lines = [line for line in err.strip().splitlines() if not line.startswith(("note:", "WARNING:tensorflow"))]
    assert process.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert lines == [f"interrupted: the run in {out} stopped (Ctrl-C); every step it started is charged to its "
                     "ledger; continue it with the same command plus --resume"], err[-3000:]
    resumed = sparta_train(path, "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((out / "results.json").read_text())["epsilon"] <= 8.0 + 1e-6


def test_the_dry_run_shows_the_shuffle_caveat_as_it_shows_the_seeds(tmp_path, capsys):
    """Regression: the plan warned of a fixed seed but not of privacy.sampling=shuffle, whose batches the
    accountant does not cover (the run's report said so only at the end)."""
    config = validate(tiny_config(tmp_path / "dry", "bitfit", epochs=1))
    run.dry_run(config, compare_bands=False)
    assert "sampling=" not in capsys.readouterr().out
    config["privacy"]["sampling"] = "shuffle"
    run.dry_run(config, compare_bands=False)
    warnings = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert len(warnings) == 2 and run.SEED_CAVEAT in warnings[0], warnings
    assert ("WARNING: batches are drawn with sampling='shuffle'; the accountant's guarantee assumes Poisson "
            "sampling and does not cover fixed-size shuffled batches, so the planned epsilon is not a proven "
            "guarantee for this run.") in warnings[1]


def test_a_cached_pretrained_model_is_reused_only_under_its_configuration(tmp_path, capsys):
    """Regression: a cached pretrained.keras made under another pre-training configuration (e.g. by a run
    that then failed) was reused as it was."""
    out = tmp_path / "run"
    out.mkdir()
    config = tiny_config(out, "bitfit")
    config["pretrain"] = {"enabled": True, "epochs": 1, "augment": False, "batch_size": 32,
                          "data": {"source": "synthetic", "num_examples": 48, "num_classes": 2}}
    config = validate(config)
    private = run.load_private_data(config)

    def source():
        return pretraining.pretrained_source(config, str(out))[0]

    assert source() == "data"
    pretraining.pretrain(config, str(out), private)
    assert "non-private pre-training" in capsys.readouterr().out and source() == "cache"
    pretraining.pretrain(config, str(out), private)
    assert "== pre-trained model:" in capsys.readouterr().out  # the same configuration: reused
    config["pretrain"]["data"]["num_classes"] = 3
    assert source() == "stale"
    pretraining.pretrain(config, str(out), private)
    assert "made under another pre-training configuration; pre-training again" in capsys.readouterr().out
    assert json.loads((out / "pretrained.json").read_text()) == pretraining.pretraining_key(config)
    (out / "pretrained.json").unlink()  # a cache of unknown making is not trusted either
    assert source() == "stale"


def test_a_corrected_config_in_the_output_dir_of_a_failed_run_pre_trains_again(tmp_path, capsys, write_config):
    """Regression (through sparta-train): a run that pre-trained on 1-channel data, then failed, left its
    pretrained.keras; the corrected 3-channel config run into the same output_dir reused it and failed
    in Keras. The cache must be made again under the new configuration, and the run must finish."""
    from trainers import cli

    out = tmp_path / "run"

    def write(channels, noise_multiplier):
        config = tiny_config(out, "mp", epochs=2)
        config["data"]["channels"] = channels
        config["pretrain"] = {"enabled": True, "epochs": 1, "augment": False, "batch_size": 32,
                              "data": {"source": "synthetic", "num_examples": 48, "num_classes": 2,
                                       "channels": channels}}
        config["privacy"]["noise_multiplier"] = noise_multiplier
        config["export"] = {"enabled": False}
        return write_config(config, f"c{channels}.yaml")

    assert cli.main(["--config", write(1, 0.1)]) == 2  # fails after pre-training: sigma misses the target
    assert "more than privacy.target_epsilon=8" in capsys.readouterr().err
    assert (out / "pretrained.keras").exists()
    assert cli.main(["--config", write(3, None)]) == 0, capsys.readouterr().err[-2000:]
    assert "made under another pre-training configuration; pre-training again" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["epsilon"] <= 8.0 + 1e-6
    assert json.loads((out / "pretrained.json").read_text())["pretrain"]["data"]["channels"] == 3


def test_one_process_owns_an_output_dir(tmp_path):
    from trainers.run_dir import RunDirectory

    config = validate(tiny_config(tmp_path / "owned", "bitfit", epochs=1))
    with RunDirectory(config["output_dir"], config, resume=False):
        with pytest.raises(run.ConfigError, match="is in use by another sparta-train"):
            run.train(config)
    results = run.train(config)  # the lock is released with its owner
    assert results["method"] == "bitfit"


def test_resume_accepts_a_config_recorded_before_a_key_was_added(tmp_path):
    from trainers.run_dir import RunDirectory

    out = tmp_path / "run"
    config = validate(tiny_config(out, "bitfit", epochs=2))
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "journal.json").write_text(json.dumps({"started_through": 3}))
    older = json.loads(json.dumps(config))
    del older["training"]["deterministic"]  # recorded by a version without the key
    (out / "config.json").write_text(json.dumps(older))
    with RunDirectory(str(out), config, resume=True) as run_dir:
        assert run_dir.resume


def test_resume_refuses_another_config(tmp_path):
    out = tmp_path / "run"
    config = validate(tiny_config(out, "bitfit", epochs=2))
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "journal.json").write_text(json.dumps({"started_through": 3}))
    (out / "config.json").write_text(json.dumps(config))
    other = validate(tiny_config(out, "all", epochs=2))
    with pytest.raises(run.ConfigError, match="started with another method section"):
        run.train(other, resume=True)
    results = run.train(config, resume=True)  # no checkpoint: starts over, the 3 started steps charged
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["entries"][0]["phase"] == "interrupted" and ledger["entries"][0]["count"] == 3
    assert results["steps"] == 3 + results["optimizer_steps"] >= 3 + round(1 / results["sample_rate"])
    assert results["epsilon"] <= 8.0 + 1e-6
