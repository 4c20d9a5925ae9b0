"""Keras 2 behind tf.keras on both TensorFlow lines, and a one-line refusal of Keras 3."""

import importlib.util
import os
import subprocess
import sys

import pytest

from sparta_tf import keras2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW_LINE = importlib.util.find_spec("tf_keras") is not None  # TF >= 2.16 with tf-keras


def _python(code: str, **env):
    environment = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    environment.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300)


def test_tf_keras_is_keras_2_once_sparta_tf_is_imported():
    done = _python("import sparta_tf, tensorflow as tf; from sparta_tf.keras2 import keras_version; "
                   "print(keras_version()); print(type(tf.keras.layers.Dense(2)).__module__)")
    assert done.returncode == 0, done.stderr[-2000:]
    version, module = done.stdout.split()[-2:]
    assert version.startswith("2.")
    assert module.startswith("tf_keras" if NEW_LINE else "keras.src")


def test_keras_3_is_refused_with_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(keras2, "keras_version", lambda: "3.15.1")
    with pytest.raises(keras2.Keras3Error, match="needs Keras 2, but tf.keras is Keras 3.15.1.*TF_USE_LEGACY_KERAS"):
        keras2.check_keras2()


@pytest.mark.skipif(not NEW_LINE, reason="TF 2.15 has Keras 2 built in: Keras 3 cannot be active there")
@pytest.mark.parametrize("code, env", [
    ("import tensorflow as tf; tf.keras.layers.Dense; import sparta_tf", {}),  # TF first, Keras 3 resolved
    ("import sparta_tf", {"TF_USE_LEGACY_KERAS": "0"}),  # the user asked for Keras 3
])
def test_a_process_with_keras_3_active_gets_the_one_line_error(code, env):
    done = _python(code, **env)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sparta_tf.keras2.Keras3Error: sparta-tf needs Keras 2") and "TF_USE_LEGACY_KERAS" in last
