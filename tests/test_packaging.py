"""Package metadata tells the truth: one version, and core dependencies are what the library imports."""

import pathlib
import subprocess
import sys
import tomllib

import sparta_tf

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_the_one_in_pyproject():
    assert sparta_tf.__version__ == PYPROJECT["project"]["version"]


def test_the_library_does_not_import_tf_privacy_which_is_not_a_core_dependency():
    core = " ".join(PYPROJECT["project"]["dependencies"])
    assert "tensorflow-privacy" not in core and "matplotlib" not in core
    # Keras 3 imports matplotlib itself when it is installed (keras.src.visualization): what Keras
    # imports before sparta_tf is imported is not ours, so it is the baseline.
    code = ("import sys, sparta_tf.backend, tensorflow as tf; tf.keras.layers.Dense; before = set(sys.modules); "
            "import sparta_tf, sparta_tf.data, sparta_tf.models.zoo, trainers.run, trainers.check_export; "
            "bad = [m for m in ('tensorflow_privacy', 'matplotlib', 'torch') if m in set(sys.modules) - before]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-500:]
