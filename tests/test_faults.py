"""Every fault survivable: kill -9 in every phase and in the last epoch, damaged checkpoints, a diverging
run, a full disk, stale temporaries. Epsilon is never under-counted, whatever happens."""

import dataclasses
import errno
import json
import os
import signal
import time
from unittest import mock

import pytest
import tensorflow as tf

from sparta_tf import checkpointing
from sparta_tf.privacy import charging
from sparta_tf.privacy.ledger import LedgerEntry, PrivacyLedger
from sparta_tf.privacy.mechanism import DpSgdMechanism
from small_runs import sparta_train, start_sparta_train
from trainers import cli, run
from trainers.config import validate

EPOCHS, PER_EPOCH = 5, 10  # synthetic n = 120 train examples, batch 12 -> q = 0.1, 10 steps per epoch


def tiny(output_dir, method="sparta", epochs=EPOCHS, **training):
    return {
        "data": {"source": "synthetic", "num_examples": 160, "num_classes": 3, "val_fraction": 0.0,
                 "test_fraction": 0.25},
        "model": {"name": "cifar_resnet_gn", "depth": 8, "width": 4},
        "method": {"name": method, "density": 0.25, **({"warmup_epochs": 1} if method == "sparta" else {})},
        "privacy": {"target_epsilon": 8.0, "delta": 1e-3},
        "training": {"epochs": epochs, "batch_size": 12, "learning_rate": 0.05, "seed": 0, **training},
        "output_dir": str(output_dir),
    }


def _kill_during(config_path, out, step, timeout=300):
    """Starts sparta-train and SIGKILLs it once the journal says ``step`` started."""
    process = start_sparta_train(config_path)
    journal = out / "checkpoints" / "journal.json"
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and process.poll() is None:
            try:
                if json.loads(journal.read_text())["started_through"] >= step:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not (out / "results.json").exists(), "the run finished before it could be killed"
    return json.loads(journal.read_text())["started_through"]


# A kill in each phase: the selection epoch is tests/test_cli_run.py::test_sigkill_mid_epoch_then_resume_never_undercounts,
# the sparse phase tests/test_multi_worker.py::test_kill_9_one_worker_then_resume_all_never_undercounts, the warm-up
# before the first checkpoint tests/test_make_private.py::test_a_killed_fit_resumes_without_under_counting[2], the
# last epoch here (every phase resumes through the same journal and checkpoint code; each kill costs fresh processes).
def test_a_kill_in_the_last_epoch_finishes_it_partially_when_the_budget_is_spent(tmp_path, write_config):
    """The plan spends the whole budget; the interrupted steps charged on resume leave less than the
    last epoch: the resumed run trains what still fits, stops, and says so."""
    out = tmp_path / "run"
    path = write_config(tiny(out, "bitfit"))
    started = _kill_during(path, out, 46)
    assert started >= 46
    result = sparta_train(path, "--resume", timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["epsilon"] <= 8.0 + 1e-6
    assert results["training_steps_run"] < EPOCHS * PER_EPOCH
    assert results["stopped_early"] and results["epochs_completed"] < EPOCHS


def _finished_two_checkpoints(tmp_path):
    out = tmp_path / "run"
    config = validate(tiny(out, "bitfit", epochs=3))
    run.train(config)
    os.remove(out / "results.json")  # pretend the run was killed after its last checkpoint
    os.remove(out / "checkpoints" / "journal.json")
    return out, config


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, capsys):
    out, config = _finished_two_checkpoints(tmp_path)
    newest, older = checkpointing.candidates(str(out))
    (tmp_path / "run" / "checkpoints" / os.path.basename(newest) / "state.json").write_text("{not json")
    path, state = checkpointing.latest(str(out))
    assert path == older and "is damaged" in capsys.readouterr().out
    shard = [f for f in os.listdir(older) if f.startswith("ckpt.data")][0]
    with open(os.path.join(older, shard), "r+b") as f:
        f.truncate(10)  # truncated weights: unreadable
    (out / "checkpoints" / "journal.json").write_text(json.dumps({"started_through": 30}))
    with pytest.raises(checkpointing.CheckpointError, match="cannot be restored"):
        run.train(config, resume=True)


def test_a_resume_that_would_draw_other_noise_than_the_killed_run_is_refused_before_a_step(tmp_path):
    out, config = _finished_two_checkpoints(tmp_path)
    newest = checkpointing.candidates(str(out))[0]
    state = json.loads((tmp_path / "run" / "checkpoints" / os.path.basename(newest) / "state.json").read_text())
    assert state["noise_drawn_by_xla"] is False  # jit_compile 'auto' on CPU
    for path in checkpointing.candidates(str(out)):  # as if the killed run had compiled its step with XLA
        state_path = os.path.join(path, "state.json")
        with open(state_path) as f:
            written = json.load(f)
        with open(state_path, "w") as f:
            json.dump(dict(written, noise_drawn_by_xla=True), f)
    ledger_before = (out / "ledger.json").read_text()
    with pytest.raises(checkpointing.CheckpointError, match="compiled with XLA.*resume with jit_compile=True"):
        run.train(config, resume=True)
    assert (out / "ledger.json").read_text() == ledger_before and not (out / "results.json").exists()


def test_lost_steps_and_mechanisms_before_training_are_charged_as_the_killed_run_ran_them(tmp_path):
    """A resume with another plan (from Python, make_private with another budget) would charge the killed run's
    lost steps at its own noise: the journal records the steps' mechanism, and another is refused; the
    mechanisms before training are charged as the killed runs recorded them."""
    out = tmp_path / "run"
    config = validate(tiny(out, "bitfit", epochs=2))
    results = run.train(config)
    journal = json.loads((out / "checkpoints" / "journal.json").read_text())
    assert journal["mechanism"] == {"noise_multiplier": results["noise_multiplier"],
                                    "sample_rate": journal["mechanism"]["sample_rate"], "bands": 1}
    ran = DpSgdMechanism(journal["mechanism"]["noise_multiplier"], journal["mechanism"]["sample_rate"])
    step = journal["started_through"]
    (out / "checkpoints" / "journal.json").write_text(json.dumps(dict(journal, started_through=step + 3)))
    strategy = tf.distribute.get_strategy()
    ledger = PrivacyLedger(1e-5)
    with pytest.raises(checkpointing.CheckpointError, match="ran its steps with noise multiplier .*resume with the "
                                                            "privacy settings it was started with"):
        charging.charge_interrupted_steps(str(out), step, ledger, dataclasses.replace(ran, noise_multiplier=9.0),
                                          strategy)
    assert not ledger.entries
    assert charging.charge_interrupted_steps(str(out), step, ledger, ran, strategy) == 3
    assert [(e.noise_multiplier, e.count) for e in ledger.entries] == [(ran.noise_multiplier, 3)]

    before = LedgerEntry(1.5, 0.5, 2, phase="selection")
    charging.journal_before_training(str(out), PrivacyLedger(1e-5), [before])
    other_plan = [dataclasses.replace(before, noise_multiplier=4.0)]
    ledger = PrivacyLedger(1e-5)
    assert charging.charge_interrupted_before_training(str(out), ledger, other_plan, strategy) == 1
    assert [(e.noise_multiplier, e.count, e.phase) for e in ledger.entries] == [(1.5, 2, "interrupted")]


def test_a_checkpoint_of_another_model_and_a_damaged_journal_are_clear_errors(tmp_path, capsys, write_config):
    out, config = _finished_two_checkpoints(tmp_path)
    other = dict(config, model={"name": "cifar_resnet_gn", "depth": 14, "width": 4})
    (out / "config.json").unlink()  # no config to compare: the checkpoint itself must be refused
    status = cli.main(["--config", write_config(other), "--resume"])
    err = capsys.readouterr().err
    assert status == 1 and "cannot be restored" in err, err
    (out / "checkpoints" / "journal.json").write_text("{broken")
    (out / "config.json").unlink()  # the failed resume above recorded its config
    status = cli.main(["--config", write_config(config), "--resume"])
    err = capsys.readouterr().err
    assert status == 1 and "journal" in err and "is damaged" in err, err


def test_a_diverging_run_stops_with_an_error_and_exports_nothing(tmp_path, capsys, write_config):
    out = tmp_path / "run"
    config = tiny(out, "all", epochs=2, learning_rate=3e38)
    status = cli.main(["--config", write_config(config)])
    err = capsys.readouterr().err
    # a rate near float32's largest overflows the weights at the first noisy step; the guard reads the weights
    # (what the DP steps release), never the count of dropped examples, which is a statistic of the data
    assert status == 1 and "training diverged" in err, err
    assert not (out / "results.json").exists() and not (out / "export").exists()


def test_a_full_disk_is_a_one_line_error_and_leaves_no_temporaries(tmp_path, capsys, write_config):
    out = tmp_path / "run"
    config = tiny(out, "bitfit", epochs=2)
    real = checkpointing.write_atomic
    calls = {"n": 0}

    def full_after_some_writes(path, text):
        calls["n"] += 1
        if calls["n"] > 12:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, text)

    with mock.patch.object(checkpointing, "write_atomic", full_after_some_writes):
        status = cli.main(["--config", write_config(config)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and "No space left on device" in lines[-1] and "free disk space" in lines[-1], lines
    leftovers = [p for p in out.rglob("*") if p.name.startswith((".tmp-", ".partial-"))]
    assert not leftovers
    status = cli.main(["--config", write_config(config), "--resume"])  # space is back: it completes
    assert status == 0 and (out / "results.json").exists()


def test_the_owner_removes_what_killed_writers_left(tmp_path):
    out = tmp_path / "run"
    stale = [out / "export" / ".tmp-export-abc", out / "checkpoints" / ".partial-xyz", out / ".tmp-123",
             out / "mask" / ".tmp-npz", out / "mask" / "mask.npz.tmp-77", out / "pretrained.keras.tmp.keras"]
    for path in stale[:2]:
        path.mkdir(parents=True)
    for path in stale[2:]:  # files: a killed text, mask or pre-training writer (old names included)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("half")
    (out / "checkpoints" / "journal.json").write_text(json.dumps({"started_through": 2}))
    results = run.train(validate(tiny(out, "bitfit", epochs=1)), resume=True)
    assert results["steps"] >= 2 + PER_EPOCH - 2  # the 2 started steps stay charged
    assert not any(path.exists() for path in stale)


def test_a_run_killed_twice_after_its_pre_pruning_charges_every_pruning_on_resume(tmp_path):
    """Regression: a DP-SSGD run stopped after DP-SNIP, before any step, held no journal, so it could
    start afresh, and on resume DP-SNIP ran again under a new secret seed (a second release) while
    the ledger charged one. Now every started DP-SNIP stays charged as ``interrupted``, however
    many times the run was killed before its first checkpoint."""
    from sparta_tf import ssgd as ssgd_module

    out = tmp_path / "run"
    config = tiny(out, "dp_ssgd", epochs=1, seed=None)
    config["method"].update({"prune": "dp_snip", "prune_rate": 0.5})
    config = validate(config)
    real = ssgd_module.prune_dp_snip

    def killed_after_pruning(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("killed")

    with mock.patch.object(ssgd_module, "prune_dp_snip", killed_after_pruning), pytest.raises(RuntimeError):
        run.train(config)
    with pytest.raises(run.ConfigError, match="interrupted run"):
        run.train(config)
    with mock.patch.object(ssgd_module, "prune_dp_snip", killed_after_pruning), pytest.raises(RuntimeError):
        run.train(config, resume=True)
    results = run.train(config, resume=True)
    ledger = json.loads((out / "ledger.json").read_text())
    snip = [(e["phase"], e["count"]) for e in ledger["entries"] if e["kind"] == "dp_snip"]
    assert snip == [("interrupted", 2), ("pre-pruning", 1)]
    assert results["epsilon"] <= 8.0 + 1e-6


def test_a_run_killed_between_its_export_and_its_results_resumes_with_a_fixed_export_version(tmp_path, capsys,
                                                                                          write_config):
    """The export is renamed into place whole, then results.json is written: a kill in between left a run whose
    --resume refused the existing export version forever. It keeps the export (the same final weights)."""
    out = tmp_path / "run"
    config = dict(tiny(out, "bitfit", epochs=2), export={"enabled": True, "version": 7})
    path = write_config(config)
    assert cli.main(["--config", path]) == 0
    exported = sorted(p.name for p in (out / "export" / "7").rglob("*"))
    (out / "results.json").unlink()  # as a kill after the export's rename leaves it
    capsys.readouterr()
    assert cli.main(["--config", path, "--resume"]) == 0, capsys.readouterr().err
    assert "of this run exists already; kept" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["export_dir"].endswith(os.path.join("export", "7"))
    assert sorted(p.name for p in (out / "export" / "7").rglob("*")) == exported
