"""The CLI's TF-Serving export, served in a fresh process without sparta_tf, reproduces the run.

One run per config style: the quickstart (digits, no normalisation) and the
quickstart with ``normalize: standard`` (per-channel statistics of the
training split, baked into the export), both shortened, and on ResNet-8-GN
instead of ResNet-20-GN, so that they fit CI.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from sparta_tf.export import export_for_serving
from trainers import check_export, cli
from trainers.config import load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAVED_MODEL_CLI = pathlib.Path(sys.executable).with_name("saved_model_cli")

# ResNet-8-GN (the quickstart's network family, a third of its layers) keeps the export path the same
SHORT_QUICKSTART = ["pretrain.epochs=6", "training.epochs=3", "method.warmup_epochs=1",
                    "model={name: cifar_resnet_gn, depth: 8}"]
NORMALISED = SHORT_QUICKSTART + [  # per-channel standardisation with training-split statistics
    "data.normalize=standard",
    "pretrain.data={source: digits, classes: [0, 1, 2, 3, 4], normalize: standard}",
]
STYLES = {
    "quickstart": ("configs/quickstart.yaml", SHORT_QUICKSTART),
    "normalised": ("configs/quickstart.yaml", NORMALISED),
}


@pytest.fixture(scope="module", params=sorted(STYLES))
def finished_run(request, tmp_path_factory):
    """(config, results.json) of a CLI run of one config style."""
    name = request.param
    path, overrides = STYLES[name]
    overrides = overrides + [f"output_dir={tmp_path_factory.mktemp(name) / 'run'}"]
    path = str(ROOT / path)
    assert cli.main(["--config", path] + [a for o in overrides for a in ("--set", o)]) == 0
    config = load_config(path, overrides)
    results = json.loads(pathlib.Path(config["output_dir"], "results.json").read_text())
    assert (results["export_dir"] is not None) and (config["data"].get("normalize") == "standard") == (
        name == "normalised")
    return config, results


def test_fresh_process_reproduces_the_runs_test_accuracy(finished_run):
    config, results = finished_run
    check = check_export.check_export(config)
    assert check.finite, check.describe()
    assert check.max_sum_error <= 1e-4, check.describe()
    assert abs(check.served_accuracy - results["test_accuracy"]) <= 0.005, check.describe()
    assert check.passed
    assert check.served_accuracy > 1.5 / len(config["data"]["classes"]), "the served model is at chance"


def test_saved_model_cli_serves_the_same_probabilities(finished_run, tmp_path):
    config, results = finished_run
    images, _ = check_export.raw_test_split(config)
    np.save(tmp_path / "images.npy", images[:16])
    subprocess.run(
        [str(SAVED_MODEL_CLI), "run", "--dir", results["export_dir"], "--tag_set", "serve",
         "--signature_def", "serving_default", "--inputs", f"images={tmp_path / 'images.npy'}",
         "--outdir", str(tmp_path / "out")],
        check=True, capture_output=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    served = np.load(tmp_path / "out" / "probabilities.npy")
    assert np.all(np.isfinite(served))
    np.testing.assert_allclose(served.sum(-1), 1.0, atol=1e-5)
    fresh = check_export.serve_in_fresh_process(results["export_dir"], images[:16])
    np.testing.assert_allclose(served, fresh, atol=1e-5)


def test_the_check_fails_for_an_export_of_another_model(finished_run, tmp_path):
    """Negative control: the check can fail. The run's pre-trained backbone with a fresh,
    untrained head (the model before DP fine-tuning) must miss the run's accuracy."""
    from sparta_tf.data import load_dataset
    from trainers import run

    config, _ = finished_run
    dataset = load_dataset(config["data"], seed=config["training"]["seed"])
    untrained = run.build_private_model(config, dataset, config["output_dir"])
    other = export_for_serving(untrained, str(tmp_path / "other"), preprocessing=run.serving_preprocessing(dataset))
    check = check_export.check_export(config, export_dir=other)
    assert check.finite
    assert not check.passed, check.describe()


@pytest.mark.parametrize("preprocessing, problem", [
    ({"mean": None, "std": None}, "preprocessing.mean is missing"),
    ({"mean": 0.5}, "preprocessing.std is missing"),
    ({"mean": float("nan"), "std": 1.0}, "preprocessing.mean=.* is not finite"),
    ({"mean": 0.5, "std": [1.0, float("inf"), 1.0]}, "preprocessing.std=.* is not finite"),
    ({"mean": [0.1, 0.2], "std": 1.0}, "must be a number or 3 numbers"),
    ({"mean": "zero", "std": 1.0}, "must be a number or 3 numbers"),
    ({"mean": 0.0, "std": 0.0}, "preprocessing.std must be > 0"),
])
def test_export_refuses_missing_or_non_finite_preprocessing(tmp_path, preprocessing, problem):
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.Input((4, 4, 3)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=problem):
        export_for_serving(model, str(tmp_path / "export"), preprocessing=preprocessing)
    assert not (tmp_path / "export").exists() or not os.listdir(tmp_path / "export")


def test_check_export_cli_needs_a_finished_run(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {{source: digits}}\nmodel: {{name: resnet20_gn}}\noutput_dir: {tmp_path / 'none'}\n")
    assert check_export.main(["--config", str(config)]) == 2
    assert "no finished run" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b'{"method": "sparta", "test_accur', b"", b"\xff\xfe garbage", b"[1, 2]"])
def test_check_export_cli_on_a_damaged_results_json_is_one_line(tmp_path, capsys, content):
    """Regression: a truncated results.json (a run killed while writing it by an older version, a full
    disk, a hand edit) gave a JSONDecodeError traceback."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_bytes(content)
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {{source: digits}}\nmodel: {{name: resnet20_gn}}\noutput_dir: {tmp_path / 'run'}\n")
    assert check_export.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "results.json is not" in err[0] and "run sparta-train again" in err[0], err
