"""Test session set-up (quiet TF logs, two logical CPUs for tf.distribute tests) and shared fixtures.

The logical-device split must happen before anything initialises the TF
runtime (even ``list_logical_devices`` does), hence here, first. The small
models, data and run helpers the tests share are plain functions in
``small_models.py``, ``small_configs.py``, ``small_runs.py`` and ``layer_zoo.py``.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as trainers/__init__.py (test_grouped_conv_engines turns it off)

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import yaml  # noqa: E402

try:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # runtime already initialised: the tf.distribute test skips
    pass


@pytest.fixture
def write_config(tmp_path):
    """``write_config(config, name="c.yaml")``: writes the sparta-train ``config`` dict as YAML to
    ``tmp_path / name`` and returns that path as a string (for ``--config``)."""

    def write(config: dict, name: str = "c.yaml") -> str:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(config))
        return str(path)

    return write
