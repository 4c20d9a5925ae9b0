"""sparta-tf: differentially private (sparse) fine-tuning for TensorFlow/Keras.

The top level holds the public surface the guides use: the entry point :func:`make_private`; the
core types :class:`DPModel`, :class:`PrivacyPlan`, :class:`PrivacyLedger`, :class:`Method`,
:class:`NonFiniteGuard` and :class:`NotPerExampleSafeError`; :func:`logging_only` for a callback that only
logs ``fit``'s metrics; the registries: of methods,
:data:`METHODS`, and of per-layer per-example rules, :func:`register_layer_rule`; and the helpers the guides
call (:func:`cosine_with_warmup`, :func:`calibrate_noise_multiplier`, :func:`compute_epsilon`,
:func:`export_for_serving`). Everything else, SPARTA's internals
included (``sparta_tf.groups.group_table``, ``sparta_tf.masks.save_mask``,
``sparta_tf.selection.SpartaSelector``, ``sparta_tf.callbacks.MethodCallback``, ...), is imported
from its module.

``import sparta_tf`` is cheap and changes nothing: it imports neither TensorFlow nor any
submodule and leaves ``os.environ`` as it is. A top-level name is imported on first use
(PEP 562 module ``__getattr__``), after :mod:`sparta_tf.backend` has checked the Keras behind
``tf.keras``; a submodule reached as an attribute (``sparta_tf.trainable``) is imported then too,
on its own, so the TensorFlow-free parts (``from sparta_tf import method_spec``) import without
TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from sparta_tf.lazy_exports import lazy_exports

if TYPE_CHECKING:  # for type checkers and the API reference (static); at run time __getattr__ imports them
    from sparta_tf.callbacks import NonFiniteGuard
    from sparta_tf.data.augmentation_check import check_augmentation
    from sparta_tf.dp_model import DPModel
    from sparta_tf.dp_model.training_logs import logging_only
    from sparta_tf.export import export_for_serving
    from sparta_tf.tuning.release import export_in_fresh_process
    from sparta_tf.methods import METHODS, Method
    from sparta_tf.model_checks import NotPerExampleSafeError
    from sparta_tf.optim import cosine_with_warmup
    from sparta_tf.per_example import register_layer_rule
    from sparta_tf.privacy import PrivacyLedger, calibrate_noise_multiplier, compute_epsilon
    from sparta_tf.privacy.plan import PrivacyPlan
    from sparta_tf.private_training import make_private
    from sparta_tf.tuning.library import tune_privately

__version__ = "0.3.0"

_PUBLIC: dict[str, str] = {
    "make_private": "sparta_tf.private_training",
    "tune_privately": "sparta_tf.tuning.library",
    "DPModel": "sparta_tf.dp_model",
    "logging_only": "sparta_tf.dp_model.training_logs",
    "PrivacyPlan": "sparta_tf.privacy.plan",
    "PrivacyLedger": "sparta_tf.privacy",
    "Method": "sparta_tf.methods",
    "METHODS": "sparta_tf.methods",
    "NonFiniteGuard": "sparta_tf.callbacks",
    "check_augmentation": "sparta_tf.data.augmentation_check",
    "NotPerExampleSafeError": "sparta_tf.model_checks",
    "calibrate_noise_multiplier": "sparta_tf.privacy",
    "compute_epsilon": "sparta_tf.privacy",
    "cosine_with_warmup": "sparta_tf.optim",
    "export_for_serving": "sparta_tf.export",
    "export_in_fresh_process": "sparta_tf.tuning.release",
    "register_layer_rule": "sparta_tf.per_example",
}
"""Each top-level name -> the module defining it (imported on first access)."""

__all__ = [
    "DPModel",
    "METHODS",
    "Method",
    "NonFiniteGuard",
    "NotPerExampleSafeError",
    "PrivacyLedger",
    "PrivacyPlan",
    "calibrate_noise_multiplier",
    "check_augmentation",
    "compute_epsilon",
    "cosine_with_warmup",
    "export_for_serving",
    "export_in_fresh_process",
    "logging_only",
    "make_private",
    "register_layer_rule",
    "tune_privately",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _PUBLIC,
                                    before=lambda: importlib.import_module("sparta_tf.backend"))
"""The first export imported checks the Keras behind ``tf.keras`` (:mod:`sparta_tf.backend`; one line if unsupported)."""
