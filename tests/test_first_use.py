"""What a new user tripped on (issue 65): the tuning CLI's help, weight-averaging options without
weight averaging."""

import subprocess
import sys

import pytest
import tensorflow as tf

import sparta_tf
from small_configs import set_key, tiny_config
from trainers.config import ConfigError, validate


def test_sparta_tune_help_names_the_distribution_and_what_resume_continues():
    result = subprocess.run([sys.executable, "-m", "trainers.tune_cli", "--help"], capture_output=True, text=True,
                            timeout=120)
    text = " ".join(result.stdout.split())
    assert result.returncode == 0
    description = text.split("options:")[0]
    assert description.rstrip().endswith("privacy.target_epsilon.") and "geometric number" in description
    assert "the same candidates (nothing is drawn again)" in text and "last checkpoint in output_dir" not in text


def small_model():
    return tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])


@pytest.mark.parametrize("value", [True, False])
def test_use_ema_weights_without_ema_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=f"use_ema_weights={value} has no effect without ema") as error:
        sparta_tf.make_private(small_model(), method="all", target_epsilon=8.0, delta=1e-5, epochs=1, batch_size=8,
                               dataset_size=64, use_ema_weights=value)
    assert "\n" not in str(error.value)
    dp = sparta_tf.make_private(small_model(), method="all", target_epsilon=8.0, delta=1e-5, epochs=1, batch_size=8,
                                dataset_size=64, ema=0.9, use_ema_weights=value)
    assert dp._use_ema_weights is value


def test_a_config_that_turns_off_averaged_weights_without_averaging_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="training.use_ema_weights=false has no effect without training.ema"):
        validate(set_key(tiny_config(tmp_path), "training.use_ema_weights", False))
    validate(set_key(set_key(tiny_config(tmp_path), "training.use_ema_weights", False), "training.ema", 0.99))
    recorded = validate(tiny_config(tmp_path))  # config.json records the default; repeating a run must work
    assert recorded["training"]["use_ema_weights"] is True and validate(recorded)["training"]["ema"] is None


def test_a_model_name_tensorflow_refuses_as_a_scope_is_refused_before_anything_runs():
    inputs = tf.keras.Input((4,))
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(2)(inputs), name="_m")
    with pytest.raises(ValueError, match=r"the model's name '_m' is not one TensorFlow accepts.*name='m'") as error:
        sparta_tf.make_private(model, method="all", target_epsilon=8.0, delta=1e-5, epochs=1, batch_size=8,
                               dataset_size=64)
    assert "\n" not in str(error.value)
