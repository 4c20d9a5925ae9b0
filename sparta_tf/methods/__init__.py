"""Named fine-tuning methods: one :class:`Method` interface, a registry, a module per family.

=============  ===========================================  ==========================================
method         trainable set                                how it is chosen (privacy cost)
=============  ===========================================  ==========================================
``all``        every trainable variable                     - (:mod:`.dense`)
``last``       head + normalisation parameters              -
``bitfit``     biases + norms + head (DP-BitFit)            -
``x_bitfit``   X epochs every parameter, then bias terms    - (DP-BiTFiT two-phase, Bu et al. 2024)
``mp``         biases + norms + head + top-``|W_old|``       public pre-trained weights, free
               entries per layer (paper Alg. 4)             (:mod:`.static_masks`)
``random``     biases + norms + head + random rows          seeded, data-independent, free
``sparta``     warm-up: biases + norms + head; then + the    one epoch of private row scores, part of
               selected rows per layer                      the run's T epochs (:mod:`.selection_epoch`)
``dpsgd_grad`` as sparta, entries                           one epoch of noisy DP-SGD gradients (Alg. 2)
``oracle``     as sparta, entries                           exact ``|g|`` (Alg. 3): NOT private
``dp_frost``   the layers PSEL selects, up to gamma|Theta|  T noisy partition-magnitude rounds before
                                                            training, charged (:mod:`.frost`)
``dp_ssgd``    kept entries after pre-pruning, a subset     random/Synflow free; DP-SNIP one Gaussian
               of them at every step                        release, charged (:mod:`.ssgd`)
=============  ===========================================  ==========================================

Each method is one class bound to its spec, the TensorFlow-free data of
:mod:`sparta_tf.method_spec` (options, defaults, valid values, phase
templates; ``sparta-train``'s config checker reads the same spec objects):
``class Sparta(SelectionEpochMethod, spec=SPECS["sparta"])``. Creating the
class registers it in :data:`METHODS` (:mod:`.base`), so a method written
outside the package (docs/write-a-method.md) is one class too.
``make_method(name, **options)`` builds one; ``make_private`` and
``sparta-train`` plan and run it, :class:`sparta_tf.callbacks.MethodCallback` drives it
inside a ``DPModel.fit`` you set up yourself.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from sparta_tf.methods import frost, ssgd, static_masks  # noqa: F401  (importing a class registers it)
from sparta_tf.methods.base import COMMON_OPTIONS, METHODS, Method, PreparedMethod, SetMethod
from sparta_tf.methods.dense import XBitFit
from sparta_tf.methods.masked import MaskedMethod
from sparta_tf.methods.selection_epoch import SelectionEpochMethod
from sparta_tf.methods.sets import ALWAYS_TRAINABLE, bias_terms_set, dense_selections, role_set, warmup_set
from sparta_tf.trainable import TrainableSet, VariableSelection


def method_class(name: str) -> type[Method]:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    return METHODS[name]


def make_method(name: str, **options: Any) -> Method:
    """The method ``name`` with ``options`` (its own, see ``METHODS[name].spec``, plus
    :data:`COMMON_OPTIONS`: ``head``, ``head_learning_rate_scale``, ``mask_dir``, ``verbose``)."""
    return method_class(name)(**options)


def trainable_set(model: tf.keras.Model, method: str, mask: Sequence[VariableSelection] | None = None, head=None,
                  head_learning_rate_scale: float = 1.0) -> TrainableSet:
    """The final trainable set of a role-based or masked ``method`` once its ``mask`` (if any) is known."""
    cls = method_class(method)
    if issubclass(cls, MaskedMethod):
        if mask is None:
            raise ValueError(f"method {method!r} needs a mask; select one first")
        return role_set(model, ALWAYS_TRAINABLE, mask, head, head_learning_rate_scale)
    if cls is XBitFit:
        return bias_terms_set(model, head)
    if not hasattr(cls, "roles"):
        raise ValueError(f"method {method!r} chooses its trainable set itself before training")
    return role_set(model, cls.roles, (), head, head_learning_rate_scale)


__all__ = [
    "ALWAYS_TRAINABLE", "COMMON_OPTIONS", "METHODS", "Method", "MaskedMethod", "PreparedMethod",
    "SelectionEpochMethod", "SetMethod", "bias_terms_set", "dense_selections", "make_method", "method_class",
    "role_set", "trainable_set", "warmup_set",
]
