"""sparta-train config validation: every malformed config is one clean line, before TensorFlow loads."""

import json
import subprocess
import sys

import pytest
import yaml

from small_configs import DELETE, set_key
from trainers.config import ConfigError, apply_overrides, check_against_data, load_config, validate

BASE = {
    "data": {"source": "synthetic"},
    "model": {"name": "resnet20_gn"},
    "output_dir": "runs/x",
    "method": {"name": "sparta"},
    "training": {"epochs": 10},
}


def with_change(path, value):
    return set_key(yaml.safe_load(yaml.safe_dump(BASE)), path, value)

MALFORMED = [
    ("bogus", 1, "unknown section 'bogus'"),
    ("data", DELETE, "missing required 'data'"),
    ("model", DELETE, "missing required 'model'"),
    ("output_dir", DELETE, "missing required 'output_dir'"),
    ("output_dir", 3, "output_dir=3 must be a string"),
    ("data", "mnist", "data must be a mapping"),
    ("data", {"path": "x.npz"}, "data.source is required"),
    ("model", {"depth": 20}, "model.name is required"),
    ("method", [1, 2], "method must be a mapping"),
    ("method.nam", "sparta", "unknown key method.nam"),
    ("method.name", "lora", "method.name='lora' must be one of"),
    ("method.name", ["sparta"], "method.name=['sparta'] must be one of"),
    ("method.density", 1.5, "method.density=1.5 must be in [0, 1]"),
    ("method.density", -0.1, "method.density=-0.1 must be in [0, 1]"),
    ("method.density", "high", "method.density='high' must be"),
    ("method.warmup_epochs", 9, "method.warmup_epochs=9 must be < training.epochs - 1"),
    ("method.warmup_epochs", -1, "method.warmup_epochs=-1 must be >= 0"),
    ("method.warmup_epochs", 2.5, "method.warmup_epochs=2.5 must be an integer"),
    ("method.score", "max", "method.score='max' is not a score of sparta; use sum_abs or abs_sum"),
    ("method.score", 7, "method.score=7 must be a string or null"),
    ("method.granularity", "block", "method.granularity='block' must be one of row, entry"),
    ("method.seed", -1, "method.seed=-1 must be in [0, 2**63)"),
    ("method.density_overrides", {"conv*": 2}, "every density must be a number in [0, 1]"),
    ("privacy.target_epsilon", 0, "privacy.target_epsilon=0 must be > 0"),
    ("privacy.target_epsilon", -1, "privacy.target_epsilon=-1 must be > 0"),
    ("privacy.target_epsilon", "eight", "privacy.target_epsilon='eight' must be"),
    ("privacy.delta", 1, "privacy.delta=1 must be in (0, 1)"),
    ("privacy.delta", 0, "privacy.delta=0 must be in (0, 1)"),
    ("privacy.clip_norm", 0, "privacy.clip_norm=0 must be > 0"),
    ("privacy.accountant", "moments", "privacy.accountant='moments' must be one of"),
    ("privacy.sampling", "uniform", "privacy.sampling='uniform' must be one of"),
    ("privacy.noise_multiplier", -1, "privacy.noise_multiplier=-1 must be >= 0"),
    ("privacy.noise_multiplier", 0, "privacy.noise_multiplier=0 gives no privacy"),
    ("training.epochs", 0, "training.epochs=0 must be >= 1"),
    ("training.epochs", True, "training.epochs=True must be an integer"),
    ("training.batch_size", 0, "training.batch_size=0 must be a number > 0"),
    ("training.physical_batch_size", 0, "training.physical_batch_size=0 must be >= 1"),
    ("training.optimizer", "rmsprop", "training.optimizer='rmsprop' must be one of"),
    ("training.momentum", 1.0, "training.momentum=1.0 must be in [0, 1)"),
    ("training.learning_rate", 0, "training.learning_rate=0 must be > 0"),
    ("training.head_learning_rate", -0.1, "training.head_learning_rate=-0.1 must be > 0"),
    ("training.schedule", "step", "training.schedule='step' must be one of"),
    ("training.warmup_fraction", 1.0, "training.warmup_fraction=1.0 must be in [0, 1)"),
    ("training.weight_decay", -1e-4, "training.weight_decay=-0.0001 must be >= 0"),
    ("training.jit_compile", "yes", "training.jit_compile='yes' must be true, false or auto"),
    ("training.engine", "fast", "training.engine='fast' must be one of"),
    ("training.max_memory", "2 gigs", "training.max_memory='2 gigs' must be a size in bytes >= 0, e.g. 2000000000 or '2GiB'"),
    ("training.max_memory", -1, "training.max_memory=-1 must be a size in bytes >= 0"),
    ("training.lr", 0.1, "unknown key training.lr"),
    ("pretrain.epochs", 0, "pretrain.epochs=0 must be >= 1"),
    ("pretrain.optimizer", "lamb", "pretrain.optimizer='lamb' must be one of"),
    ("export.version", 0, "export.version=0 must be >= 1"),
    ("method.full_epochs", -1, "method.full_epochs=-1 must be >= 0"),
    ("method.r_eps", 1.0, "method.r_eps=1.0 must be in (0, 1)"),
    ("method.q_ps", 0, "method.q_ps=0 must be in (0, 1)"),
    ("method.frost_alpha", 3, "method.frost_alpha=3 must be one of 1, 2"),
    ("method.frost_magnitude", "mga", "method.frost_magnitude='mga' must be one of"),
    ("method.gamma", 0, "method.gamma=0 must be in (0, 1]"),
    ("method.prune", "magnitude", "method.prune='magnitude' must be one of"),
    ("method.prune_rate", 1.0, "method.prune_rate=1.0 must be in [0, 1)"),
    ("method.drop_rate", -0.5, "method.drop_rate=-0.5 must be in [0, 1)"),
    ("method.drop_mode", "topk", "method.drop_mode='topk' must be one of"),
    ("method.snip_noise_multiplier", 0, "method.snip_noise_multiplier=0 must be > 0"),
]


@pytest.mark.parametrize("path,value,message", MALFORMED, ids=[f"{p}={v!r}"[:40] for p, v, _ in MALFORMED])
def test_malformed_config_gives_one_line_error(path, value, message):
    with pytest.raises(ConfigError) as error:
        validate(with_change(path, value))
    text = str(error.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize("size,expected", [("2GiB", 2 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                           (0, 0), (10**9, 10**9), (None, None)])
def test_max_memory_is_read_the_same_by_the_config_and_the_library(size, expected):
    from sparta_tf.choices import memory_bytes
    assert validate(with_change("training.max_memory", size))["training"]["max_memory"] == size
    assert memory_bytes(size) == expected


def test_x_bitfit_needs_a_bias_phase():
    with pytest.raises(ConfigError, match="method.full_epochs=10 must be < training.epochs"):
        validate(with_change("method", {"name": "x_bitfit", "full_epochs": 10, "warmup_epochs": 0}))


def test_switching_method_drops_other_methods_options_with_a_note():
    config = validate(with_change("method", {"name": "bitfit", "warmup_epochs": 2, "density": 0.3}))
    assert config["method"] == {"name": "bitfit"}
    assert config["notes"] == ["method.warmup_epochs=2 does not apply to method bitfit; ignored",
                               "method.density=0.3 does not apply to method bitfit; ignored"]
    assert validate(BASE)["notes"] == []


def test_a_value_only_another_method_takes_is_dropped_with_a_note():
    """``score: signed`` is dpsgd_grad's; under sparta it falls back to sparta's default, with a note."""
    config = validate(with_change("method", {"name": "sparta", "score": "signed", "granularity": "entry"}))
    assert config["method"]["score"] == "sum_abs" and config["method"]["granularity"] == "entry"
    assert config["notes"] == ["method.score='signed' does not apply to method sparta (its score is one of "
                               "sum_abs, abs_sum); ignored, using 'sum_abs'"]
    config = validate(with_change("method", {"name": "dpsgd_grad", "granularity": "row"}))
    assert config["method"]["granularity"] == "entry" and "method.granularity='row'" in config["notes"][0]


def test_null_method_options_mean_the_methods_default():
    config = validate(with_change("method", {"name": "mp", "granularity": None}))
    assert config["method"]["granularity"] == "entry"


def test_a_validated_config_validates_to_itself():
    once = validate(BASE)
    assert validate(once) == once


def test_defaults_fill_in():
    config = validate(BASE)
    assert config["method"]["warmup_epochs"] == 2  # T/5
    assert config["privacy"]["target_epsilon"] == 8.0 and config["training"]["momentum"] == 0.9


def test_data_dependent_checks():
    config = validate(BASE)
    with pytest.raises(ConfigError, match=r"privacy.delta=1e-05 must be < 1/n"):
        check_against_data(config, 200_000)
    config["privacy"]["delta"] = 1e-9
    with pytest.raises(ConfigError, match="training.batch_size=500 is larger than the training set"):
        check_against_data(config, 100)


def test_overrides_parse_yaml_values():
    config = apply_overrides(BASE, ["privacy.target_epsilon=2", "privacy.delta=1e-6", "method.name=mp",
                                    "training.jit_compile=false"])
    assert config["privacy"] == {"target_epsilon": 2, "delta": 1e-6}
    assert config["method"]["name"] == "mp" and config["training"]["jit_compile"] is False
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        apply_overrides(BASE, ["privacy.delta"])


def test_exponent_floats_read_as_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads ``1e-5`` as a string; the config loader reads it as YAML 1.2 and JSON do."""
    path = tmp_path / "eps.yaml"
    path.write_text(yaml.safe_dump(BASE) + "privacy: {target_epsilon: 2e0, delta: 1e-5}\n")
    privacy = load_config(str(path))["privacy"]
    assert privacy["delta"] == 1e-5 and privacy["target_epsilon"] == 2.0
    quoted = tmp_path / "quoted.yaml"
    quoted.write_text(yaml.safe_dump(BASE) + "privacy: {delta: '1e-5'}\n")
    with pytest.raises(ConfigError, match="privacy.delta='1e-5' must be"):
        load_config(str(quoted))


def test_a_runs_config_json_loads_as_the_same_config(tmp_path):
    """``sparta-train --config RUN/config.json`` repeats a run: the JSON the run wrote (``1e-05``) reloads."""
    config = validate(with_change("privacy", {"delta": 1e-5, "target_epsilon": 1.0}))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config, indent=1))
    assert '"delta": 1e-05' in path.read_text()
    assert load_config(str(path)) == config


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {source: digits\nmodel: [")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_config(str(listy))


def test_cli_reports_config_errors_fast_without_tensorflow(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(with_change("privacy.target_epsilon", -1)))
    code = (
        "import sys; from trainers.cli import main; rc = main(['--config', sys.argv[1]]); "
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["config error: privacy.target_epsilon=-1 must be > 0"]
