"""sparta-audit end to end: the audit must FAIL a DP step broken on purpose and pass the intact one.

The regime is chosen so that one canary's influence is visible when nothing
hides it: digits (all 10 classes, 540 training examples), ResNet-8-GN from
scratch, expected batch 16, 20 epochs, 270 mislabelled canaries, claimed
epsilon 1 at delta 1e-5 (the audit's ceiling here is 3.5). Each run takes
about 30 s on 2 CPU cores.
"""

import json
import os
import re

import pytest

from broken_mechanism import broken_mechanism
from trainers import audit
from trainers.config import validate

CLAIMED = 1.0


def audit_config(output_dir, method="all", **training):
    return validate({
        # split: positions keeps the calibrated regime's exact 540 training examples (hash splits are binomial)
        "data": {"source": "digits", "val_fraction": 0.1, "limit_train": 600, "split": "positions"},
        "model": {"name": "cifar_resnet_gn", "depth": 8},
        "method": {"name": method},
        "privacy": {"target_epsilon": CLAIMED, "delta": 1e-5},
        "training": {"epochs": 20, "batch_size": 16, "learning_rate": 0.1, "seed": 0, **training},
        "output_dir": str(output_dir),
    })


# Without noise and without clipping too: the SPARTA audit below
@pytest.mark.parametrize("noise, clipping", [(False, True)], ids=["no-noise"])
def test_audit_contradicts_the_claim_of_a_dp_step_broken_on_purpose(tmp_path, noise, clipping):
    with broken_mechanism(noise=noise, clipping=clipping):
        report = audit.run_audit(audit_config(tmp_path), canaries=270)
    assert report["epsilon_claimed"] == pytest.approx(CLAIMED, abs=1e-4)  # the ledger does not know
    assert report["epsilon_lower_bound"] > CLAIMED
    assert report["passed"] is False
    assert report["mia_auc"] > 0.8


def test_audit_of_the_intact_dp_step_stays_below_the_claim(tmp_path, capsys):
    report = audit.run_audit(audit_config(tmp_path), canaries=270)
    assert report["epsilon_lower_bound"] <= report["epsilon_claimed"] <= CLAIMED + 1e-4
    assert report["passed"] is True
    assert report["mia_auc"] < 0.7
    on_disk = json.loads((tmp_path / "audit" / "audit.json").read_text())
    for key in ("epsilon_claimed", "epsilon_lower_bound", "confidence", "canaries", "mia_auc", "mia_tpr_at_fpr_1e-3"):
        assert on_disk[key] == report[key]
    assert on_disk["canaries"] == 270 and on_disk["confidence"] == 0.95 and on_disk["method"] == "all"
    assert "== audit: epsilon claimed 1" in capsys.readouterr().out


def test_audit_of_sparta_runs_the_selection_epoch_and_catches_the_broken_mechanism(tmp_path):
    # Without noise alone the bound on SPARTA here is 0.88 (< 1): 20% of the rows of a network
    # trained from scratch memorise less. Without noise and clipping it is 2.48.
    config = audit_config(tmp_path, method="sparta")
    with broken_mechanism(noise=False, clipping=False):
        report = audit.run_audit(config, canaries=270)
    ledger = json.loads((tmp_path / "audit" / "ledger.json").read_text())
    assert {entry.get("phase") for entry in ledger["entries"]} >= {"warmup", "selection", "sparse"}
    assert report["method"] == "sparta" and report["epsilon_lower_bound"] > CLAIMED


def _tiny_cli_config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps({
        "data": {"source": "synthetic", "num_examples": 120, "num_classes": 3, "val_fraction": 0.1},
        "model": {"name": "cifar_resnet_gn", "depth": 8},
        "method": {"name": "bitfit"},
        "privacy": {"target_epsilon": 2.0, "delta": 1e-3},
        "training": {"epochs": 2, "batch_size": 16, "seed": 0},
        "output_dir": str(tmp_path / "run"),
    }))
    return str(path)


def test_cli_writes_audit_json_and_refuses_to_overwrite_it(tmp_path, capsys):
    config = _tiny_cli_config(tmp_path)
    assert audit.main(["--config", config, "--canaries", "40", "--score", "loss_drop"]) == 0
    report = json.loads((tmp_path / "run" / "audit" / "audit.json").read_text())
    assert report["canaries"] == 40 and report["score"] == "loss_drop" and report["passed"] is True
    assert os.path.exists(tmp_path / "run" / "audit" / "canary_losses.npz")
    assert "== audit:" in capsys.readouterr().out
    assert audit.main(["--config", config]) == 2
    assert "already holds an audit" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--canaries", "1"], "--canaries 1 must be >= 2"),
    (["--confidence", "95"], r"--confidence 95\.0 must be in \(0, 1\)"),
    (["--canaries", "100"], r"100 mislabelled canaries would take more than half of the \d+ training examples; use at most "
                            r"\d+ canaries"),
    (["--set", "privacy.delta=2"], r"privacy\.delta=2 must be in \(0, 1\)"),
])
def test_cli_errors_are_one_line_naming_the_problem(tmp_path, capsys, args, message):
    assert audit.main(["--config", _tiny_cli_config(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and len(err.splitlines()) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"score": "gradient"}, "--score gradient is unknown"), ({"kind": "poison"}, "--canary-kind poison is unknown"),
])
def test_python_api_checks_its_arguments_before_training(tmp_path, kwargs, message):
    with pytest.raises(audit.ConfigError, match=message):
        audit.run_audit(audit_config(tmp_path), **kwargs)
    assert not os.path.exists(tmp_path / "audit")


def test_the_sabotage_helper_restores_the_mechanism_even_after_an_error():
    import sparta_tf.dp_step.clipping
    import sparta_tf.dp_step.noise
    import sparta_tf.selection.scoring

    originals = (sparta_tf.dp_step.noise.gaussian_noise, sparta_tf.dp_step.clipping.clip_factors)
    with pytest.raises(RuntimeError, match="inside"):
        with broken_mechanism(noise=False, clipping=False):
            assert sparta_tf.dp_step.noise.gaussian_noise is not originals[0]
            assert sparta_tf.selection.scoring.clip_factors is not originals[1]
            raise RuntimeError("inside")
    assert sparta_tf.dp_step.noise.gaussian_noise is sparta_tf.selection.scoring.gaussian_noise is originals[0]
    assert sparta_tf.dp_step.clipping.clip_factors is sparta_tf.selection.scoring.clip_factors is originals[1]


def test_the_sabotage_helper_restores_modules_it_imported_itself():
    """In a fresh process (nothing of the selection imported yet): a module first imported inside the block
    must not keep the zero noise it bound by ``from ... import`` (it did, for every later test of the worker)."""
    import subprocess
    import sys

    script = ("import sys; sys.path.insert(0, sys.argv[1])\n"
              "from broken_mechanism import broken_mechanism\n"
              "import sparta_tf.dp_step.noise as noise\n"
              "original = noise.gaussian_noise\n"
              "with broken_mechanism(noise=False, clipping=False):\n"
              "    pass\n"
              "import sparta_tf.selection.scoring as scoring\n"
              "assert scoring.gaussian_noise is original, scoring.gaussian_noise\n")
    result = subprocess.run([sys.executable, "-c", script, os.path.dirname(os.path.abspath(__file__))],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
