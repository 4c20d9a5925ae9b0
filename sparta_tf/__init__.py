"""sparta-tf: differentially private (sparse) fine-tuning for TensorFlow/Keras.

The top level holds what the documentation uses: the entry point :func:`make_private`, the
:class:`Method` interface and its registry :data:`METHODS`, the :class:`PrivacyPlan`, the
:class:`DPModel` and its callbacks, and the accounting, mask and schedule helpers the guides
call. Everything else is imported from its module (e.g. :mod:`sparta_tf.dp_step`,
:mod:`sparta_tf.trainable`, :mod:`sparta_tf.optim`, :mod:`sparta_tf.privacy.sampling`).
"""

import os as _os

# TensorFlow's C++ start-up chatter (CUDA probes, oneDNN notes) off unless the user set a level: the CLI
# scripts (sparta-example, ...) import this package before their own code runs.
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from sparta_tf import backend  # noqa: E402,F401  (first: picks and checks the Keras behind tf.keras)
from sparta_tf.callbacks import MethodCallback, NonFiniteGuard, SpartaCallback
from sparta_tf.dp_model import DPModel
from sparta_tf.groups import group_table, row_groups
from sparta_tf.masks import load_mask, save_mask
from sparta_tf.methods import METHODS, Method
from sparta_tf.model_checks import NotPerExampleSafeError
from sparta_tf.optim import cosine_with_warmup
from sparta_tf.private_training import make_private
from sparta_tf.privacy import PrivacyLedger, calibrate_noise_multiplier, compute_epsilon
from sparta_tf.privacy.plan import PrivacyPlan
from sparta_tf.selection import SpartaSelector

__version__ = "0.3.0"

__all__ = [
    "DPModel",
    "METHODS",
    "Method",
    "MethodCallback",
    "NonFiniteGuard",
    "NotPerExampleSafeError",
    "PrivacyLedger",
    "PrivacyPlan",
    "SpartaCallback",
    "SpartaSelector",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "cosine_with_warmup",
    "group_table",
    "load_mask",
    "make_private",
    "row_groups",
    "save_mask",
]
