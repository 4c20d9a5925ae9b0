"""Which Keras tf.keras is (sparta_tf.backend): Keras 2 where tf-keras or TF 2.15 gives it, Keras 3 otherwise,
one line for anything else; the helpers behind the Keras 2 / Keras 3 differences."""

import importlib.util
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from sparta_tf import backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW_LINE = importlib.util.find_spec("tf_keras") is not None  # TF >= 2.16 with tf-keras
TF_215 = tf.__version__.startswith("2.15")


def _python(code: str, **env):
    environment = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    environment.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300)


@pytest.mark.skipif(not (NEW_LINE or TF_215), reason="neither tf-keras nor TF 2.15: tf.keras is Keras 3 here")
def test_tf_keras_is_keras_2_once_sparta_tf_is_imported():
    done = _python("import sparta_tf, tensorflow as tf; from sparta_tf.backend import keras_version, KERAS3; "
                   "print(keras_version()); print(KERAS3); print(type(tf.keras.layers.Dense(2)).__module__)")
    assert done.returncode == 0, done.stderr[-2000:]
    version, keras3, module = done.stdout.split()[-3:]
    assert version.startswith("2.") and keras3 == "False"
    assert module.startswith("tf_keras" if NEW_LINE else "keras.src")


@pytest.mark.parametrize("version, name, keras3", [
    ("2.15.0", "tensorflow", False), ("2.21.0", "tensorflow", False), ("3.10.0", "tensorflow", True),
    ("3.15.1", "tensorflow", True),
])
def test_supported_lines(version, name, keras3):
    assert backend.check_supported(version, name) is keras3


@pytest.mark.parametrize("version, name, fix", [
    ("3.15.1", "jax", "set KERAS_BACKEND=tensorflow"),
    ("3.5.0", "tensorflow", "requirements/keras3.txt"),
    ("2.13.1", "tensorflow", "requirements/keras3.txt"),
])
def test_other_kerases_get_one_line_naming_the_supported_versions(version, name, fix):
    with pytest.raises(backend.UnsupportedKerasError) as error:
        backend.check_supported(version, name)
    message = str(error.value)
    assert "\n" not in message and message.startswith("sparta-tf runs on Keras 2 (TensorFlow 2.15")
    assert f"this is Keras {version} with the {name} backend" in message and fix in message


@pytest.mark.skipif(not NEW_LINE, reason="TF 2.15 has Keras 2 built in: Keras 3 cannot be active there")
@pytest.mark.parametrize("code, env", [
    ("import tensorflow as tf; tf.keras.layers.Dense; import sparta_tf", {}),  # TF first, Keras 3 resolved
    ("import sparta_tf", {"TF_USE_LEGACY_KERAS": "0"}),  # the user asked for Keras 3
])
def test_a_process_with_keras_3_active_runs_on_the_keras_3_line(code, env):
    done = _python(code + "; print(sparta_tf.backend.KERAS3, sparta_tf.backend.keras_version())", **env)
    assert done.returncode == 0, done.stderr[-2000:]
    keras3, version = done.stdout.split()[-2:]
    assert keras3 == "True" and version.startswith("3.")


def test_keras_2_only_parts_refuse_on_keras_3_with_one_line(monkeypatch):
    monkeypatch.setattr(backend, "KERAS3", True)
    with pytest.raises(backend.Keras2OnlyError, match=r"^the thing runs on Keras 2 only so far .*TF_USE_LEGACY_KERAS=1"):
        backend.require_keras2("the thing")
    monkeypatch.setattr(backend, "KERAS3", False)
    backend.require_keras2("the thing")


def test_variable_helpers_on_this_line():
    layer = tf.keras.layers.Dense(3, name="head")
    tf.keras.Sequential([tf.keras.Input((2,)), layer])
    assert backend.variable_key(layer.kernel).endswith("head/kernel" if backend.KERAS3 else "head/kernel:0")
    raw = backend.tf_variable(layer.kernel)
    assert isinstance(raw, tf.Variable)
    before = layer.kernel.numpy()
    raw.scatter_nd_sub([[0, 1]], [1.0])  # writes through to the layer's kernel
    before[0, 1] -= 1.0
    assert (layer.kernel.numpy() == before).all()
    with pytest.raises(TypeError, match="not a TensorFlow or Keras variable"):
        backend.tf_variable(tf.constant(1.0))
