"""One method table (sparta_tf.method_spec) for the library and the config checker; --set method.name=X works
on every shipped config for every method."""

import glob
import os
import subprocess
import sys

import pytest

from sparta_tf import method_spec, methods
from trainers import config as config_module
from trainers.config import ConfigError, load_config, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
NAMES = list(method_spec.SPECS)


def test_the_config_checker_reads_the_spec_without_tensorflow_and_the_library_shares_it():
    code = (
        "import sys\n"
        "from trainers import config\n"
        "assert 'tensorflow' not in sys.modules, 'the config checker imported tensorflow'\n"
        "from sparta_tf import methods\n"
        "assert sys.modules['sparta_tf.method_spec'] is config.method_spec\n"
        "assert all(cls.spec is config.method_spec.SPECS[name] for name, cls in methods.METHODS.items())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_every_method_class_is_its_spec():
    assert list(methods.METHODS) == NAMES
    for name, cls in methods.METHODS.items():
        spec = method_spec.SPECS[name]
        assert cls.spec is spec and cls.name == name
        assert cls.options == spec.option_names and cls.private is spec.private


@pytest.mark.parametrize("name", NAMES)
def test_the_phases_a_method_runs_are_the_ones_its_spec_lists(name):
    spec = method_spec.SPECS[name]
    phases = methods.make_method(name, verbose=0).phases(10)
    assert [p.name for p in phases] == [p.name for p in spec.phases]
    assert [p.updates for p in phases] == [p.updates for p in spec.phases]


def test_options_of_one_name_take_the_same_types_in_every_method():
    for name in method_spec.ALL_OPTIONS:
        assert len({option.types for _, option in method_spec.options_named(name)}) == 1, name


def test_every_default_is_valid_and_library_and_config_refuse_a_bad_value_alike():
    for spec in method_spec.SPECS.values():
        for option in spec.options:
            assert option.problem(option.default) is None, (spec.name, option.name)
    with pytest.raises(ValueError) as library:
        methods.make_method("dp_frost", r_eps=1.5)
    with pytest.raises(ConfigError) as config:
        validate(_config({"name": "dp_frost", "r_eps": 1.5}))
    assert str(config.value) == f"method.{library.value}" == "method.r_eps=1.5 must be in (0, 1)"
    with pytest.raises(ValueError, match="method 'all' has no option 'density'"):
        methods.make_method("all", density=0.1)
    with pytest.raises(ValueError, match="score='signed' is not a score of sparta"):
        methods.make_method("sparta", score="signed")  # the library takes what it is given or refuses


def test_the_library_fills_in_the_specs_defaults():
    frost = methods.make_method("dp_frost", verbose=0)
    defaults = method_spec.SPECS["dp_frost"].defaults()
    assert (frost.r_eps, frost.q_ps, frost.gamma, frost.frost_magnitude) == (
        defaults["r_eps"], defaults["q_ps"], defaults["gamma"], defaults["frost_magnitude"])
    assert methods.make_method("mp", verbose=0).granularity == "entry"
    assert methods.make_method("sparta", verbose=0).score == "sum_abs"
    assert methods.make_method("random", verbose=0).seed is None  # the run seed's "random_mask" stream


def test_a_value_valid_for_no_method_is_refused_not_dropped():
    with pytest.raises(ConfigError, match=r"method.score='sum_abss' is not a score of dpsgd_grad; use signed"):
        validate(_config({"name": "dpsgd_grad", "score": "sum_abss"}))
    with pytest.raises(ConfigError, match=r"method.prune_rate=1.0 must be in \[0, 1\)"):
        validate(_config({"name": "sparta", "prune_rate": 1.0}))  # another method's option: still checked


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_every_shipped_config_switches_to_every_method(path):
    """``--set method.name=X`` on every shipped config: valid, X's options only, one note per dropped key."""
    given = load_config(path)["method"]
    for name in NAMES:
        config = load_config(path, [f"method.name={name}"])
        spec = method_spec.SPECS[name]
        assert config["method"]["name"] == name
        assert set(config["method"]) == {"name", *spec.option_names}, name
        for note in config["notes"]:
            assert "\n" not in note and note.startswith("method.") and f"method {name}" in note
        noted = {note.split("=")[0][len("method."):] for note in config["notes"]}
        dropped = {key for key in _raw_method(path) if key != "name" and key not in spec.option_names}
        assert dropped <= noted, (name, dropped, noted)
        again = validate(config)  # a run's recorded config reloads as itself (--resume compares the sections)
        assert again["method"] == config["method"] and again["notes"] == []
    assert given["name"] == "sparta"


def test_quickstart_switches_to_dpsgd_grad_and_oracle_with_a_note_about_the_score():
    """The issue's two failures: quickstart's ``score: sum_abs`` is sparta's."""
    path = os.path.join(ROOT, "configs", "quickstart.yaml")
    for name, score in (("dpsgd_grad", "signed"), ("oracle", "oracle")):
        config = load_config(path, [f"method.name={name}"])
        assert config["method"]["score"] == score
        assert config["notes"] == [f"method.score='sum_abs' does not apply to method {name} (its score is one of "
                                   f"{score}); ignored, using {score!r}"]


@pytest.mark.parametrize("name", NAMES)
def test_the_dry_run_of_a_switched_quickstart_builds_its_plan(name, tmp_path, capsys):
    """A real dry run (bundled data, model, method, plan; no training, a few seconds each): what the run
    checks before its first step passes for every method on the README's config."""
    from trainers import run

    path = os.path.join(ROOT, "configs", "quickstart.yaml")
    config = load_config(path, [f"method.name={name}", f"output_dir={tmp_path / 'run'}"])
    plan = run.dry_run(config, compare_bands=False)
    assert [p.name for p in plan.phases] == [p.name for p in method_spec.SPECS[name].phases]
    assert plan.private is method_spec.SPECS[name].private
    assert not (tmp_path / "run").exists()


def test_the_cli_prints_the_note_and_validates_before_tensorflow(tmp_path):
    path = os.path.join(ROOT, "configs", "quickstart.yaml")
    code = ("import sys; from trainers.config import load_config; "
            "c = load_config(sys.argv[1], ['method.name=dpsgd_grad']); "
            "assert 'tensorflow' not in sys.modules; print(c['notes'][0])")
    result = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("method.score='sum_abs' does not apply to method dpsgd_grad")


def _config(method: dict) -> dict:
    return {"data": {"source": "synthetic"}, "model": {"name": "resnet20_gn"}, "output_dir": "runs/x",
            "method": method, "training": {"epochs": 10}}


def _raw_method(path: str) -> dict:
    return config_module._yaml(open(path, encoding="utf-8").read()).get("method") or {}
