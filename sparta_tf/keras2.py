"""Keras 2 on every supported TensorFlow: imported by ``sparta_tf`` before TensorFlow itself.

sparta-tf is written against the Keras 2 API (``tf.keras`` of TF 2.15, where
Keras 2 is built in). From TF 2.16 on, ``tf.keras`` is Keras 3 unless the
environment variable ``TF_USE_LEGACY_KERAS=1`` is set before ``tf.keras`` is
first used, in which case it is the ``tf-keras`` package (Keras 2.x). This
module sets that variable when ``tf-keras`` is installed (unless the user set
it; on TF 2.15, where Keras 2 is built in, tf-keras is not installed and the
variable would make TF look for it) and then checks which
Keras ``tf.keras`` really is, so that a process that imported TensorFlow with
Keras 3 active before ``sparta_tf`` gets a one-line error instead of a late
``AttributeError`` deep inside a training step.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("tf_keras") is not None:  # TF >= 2.16 with tf-keras: use it as tf.keras
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # (TF 2.15 has Keras 2 built in; tf-keras absent)

import tensorflow as tf  # noqa: E402  (after the variable, on purpose)


class Keras3Error(ImportError):
    """``tf.keras`` is Keras 3: sparta-tf needs Keras 2 (TF 2.15, or tf-keras on TF >= 2.16)."""


def keras_version() -> str:
    """The version of the Keras behind ``tf.keras``."""
    version = getattr(tf.keras, "__version__", None)
    if version is None and getattr(tf.keras, "__name__", "").startswith("tf_keras"):
        import tf_keras

        version = tf_keras.__version__
    if version is None:
        import keras

        version = keras.__version__
    return str(version)


def check_keras2() -> None:
    """Raises :class:`Keras3Error` (one line, with the fix) when ``tf.keras`` is not Keras 2."""
    version = keras_version()
    if version.startswith("2."):
        return
    if os.environ.get("TF_USE_LEGACY_KERAS") not in ("1", "true", "True"):
        fix = "unset TF_USE_LEGACY_KERAS or set it to 1 (sparta-tf sets it itself when it is unset)"
    else:
        fix = ("import sparta_tf before anything touches tf.keras, or set TF_USE_LEGACY_KERAS=1 before "
               "importing tensorflow; and `pip install tf-keras` matching your TensorFlow")
    raise Keras3Error(f"sparta-tf needs Keras 2, but tf.keras is Keras {version} (TensorFlow {tf.__version__}): {fix}")


check_keras2()
