"""Which Keras tf.keras is (sparta_tf.backend): whatever TensorFlow resolves (importing sparta_tf changes
nothing), one line for anything unsupported; the helpers behind the Keras 2 / Keras 3 differences."""

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


@pytest.mark.skipif(not TF_215, reason="TF >= 2.16: tf.keras is Keras 2 only with tf-keras and TF_USE_LEGACY_KERAS=1")
def test_tf_215_is_the_keras_2_line():
    done = _python("import sparta_tf; from sparta_tf.backend import keras_version, KERAS3; "
                   "print(keras_version(), KERAS3)")
    assert done.returncode == 0, done.stderr[-2000:]
    version, keras3 = done.stdout.split()[-2:]
    assert version.startswith("2.15") and keras3 == "False"


@pytest.mark.skipif(not NEW_LINE, reason="tf-keras is not installed: TF_USE_LEGACY_KERAS has nothing to switch to")
@pytest.mark.parametrize("legacy, keras3", [(None, "True"), ("1", "False"), ("0", "True")])
def test_importing_sparta_tf_keeps_the_keras_tensorflow_chose(legacy, keras3):
    """With tf-keras installed, TensorFlow's switch alone picks the Keras; sparta_tf follows it."""
    code = ("import sparta_tf, os, tensorflow as tf; from sparta_tf.backend import KERAS3; "
            "print(KERAS3, os.environ.get('TF_USE_LEGACY_KERAS', '-'), type(tf.keras.layers.Dense(2)).__module__)")
    done = _python(code, **({} if legacy is None else {"TF_USE_LEGACY_KERAS": legacy}))
    assert done.returncode == 0, done.stderr[-2000:]
    found, variable, module = done.stdout.split()[-3:]
    assert found == keras3 and variable == (legacy or "-")  # the environment is left as it was
    assert module.startswith("keras.src" if keras3 == "True" else "tf_keras")


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
    assert "\n" not in message and message.startswith("sparta-tf runs on Keras >= 3.10 with the TensorFlow backend")
    assert f"this is Keras {version} with the {name} backend" in message and fix in message


@pytest.mark.skipif(TF_215, reason="TF 2.15 has Keras 2 built in: Keras 3 cannot be active there")
def test_a_process_with_keras_3_active_runs_on_the_keras_3_line():
    done = _python("import tensorflow as tf; tf.keras.layers.Dense; import sparta_tf; "
                   "print(sparta_tf.backend.KERAS3, sparta_tf.backend.keras_version())")
    assert done.returncode == 0, done.stderr[-2000:]
    keras3, version = done.stdout.split()[-2:]
    assert keras3 == "True" and version.startswith("3.")


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
