"""Test session set-up: quiet TF logs and two logical CPUs for tf.distribute tests.

The logical-device split must happen before anything initialises the TF
runtime (even ``list_logical_devices`` does), hence here, first.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as trainers/__init__.py: grouped convs need it on AMD

import tensorflow as tf  # noqa: E402

try:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # runtime already initialised: the tf.distribute test skips
    pass
