"""Command-line trainers (``sparta-train``)."""

import importlib.util as _util
import os as _os

# As sparta_tf.keras2 does (which cannot be imported here without importing TensorFlow, and
# config errors must stay fast): Keras 2 from tf-keras behind tf.keras on TF >= 2.16.
if _util.find_spec("tf_keras") is not None:
    _os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
