"""Command-line trainers (``sparta-train``)."""

from sparta_tf import keras2 as _keras2  # noqa: E402,F401  (Keras 2 behind tf.keras before any trainer imports TF)
