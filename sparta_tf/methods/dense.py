"""Methods that train whole variables by role: ``all``, ``last``, ``bitfit`` and DP-BiTFiT's ``x_bitfit``.

======== ========================================== ======================================
method   trains                                     phases
======== ========================================== ======================================
all      every trainable variable                   ``all`` (T epochs)
last     head + normalisation parameters            ``last``
bitfit   biases + norms + head (DP-BitFit)          ``bitfit``
x_bitfit X epochs everything, then the bias terms   ``full`` (X), ``bias_terms`` (T - X)
         (layer biases + norm offsets; Bu et al.
         2024, two-phase DP-BiTFiT)
======== ========================================== ======================================

None looks at private data except through the DP steps themselves.
"""

from __future__ import annotations

from typing import ClassVar

import tensorflow as tf

from sparta_tf.method_spec import SPECS, Phase
from sparta_tf.methods.base import SetMethod
from sparta_tf.methods.sets import ALWAYS_TRAINABLE, bias_terms_set, role_set
from sparta_tf.trainable import TrainableSet


class RoleMethod(SetMethod):
    """One phase, named after the method, training whole variables of ``roles``."""

    roles: ClassVar[tuple[str, ...]]

    def trainable_set(self, phase: Phase, model: tf.keras.Model) -> TrainableSet:
        return role_set(model, self.roles, (), self.head, self.head_learning_rate_scale)


class All(RoleMethod, spec=SPECS["all"]):
    roles = ("kernel", "bias", "norm", "head", "other")


class Last(RoleMethod, spec=SPECS["last"]):
    roles = ("norm", "head")


class BitFit(RoleMethod, spec=SPECS["bitfit"]):
    roles = ALWAYS_TRAINABLE


class XBitFit(SetMethod, spec=SPECS["x_bitfit"]):
    """DP-BiTFiT's two-phase ``X+BiTFiT``: ``full_epochs`` of full DP fine-tuning, then the bias terms.

    Options: ``full_epochs`` (X), ``bitfit_learning_rate_scale``
    (learning-rate multiplier of the bias phase; the paper uses 5e-3 after
    1e-3: 5). The bias phase computes no per-example weight gradient.
    """

    def phases(self, epochs: int) -> list[Phase]:
        """``full`` then ``bias_terms``; a fit shorter than ``full_epochs`` (e.g. the first part of a run
        continued with ``initial_epoch``) is all ``full`` (``sparta-train`` refuses such a config)."""
        full = min(self.full_epochs, epochs)
        phases = [self.spec.phase("full").lasting(full)] if full else []
        return phases + ([self.spec.phase("bias_terms").lasting(epochs - full)] if epochs > full else [])

    def trainable_set(self, phase: Phase, model: tf.keras.Model) -> TrainableSet:
        if phase.name == "full":
            return role_set(model, All.roles, (), self.head, self.head_learning_rate_scale)
        return bias_terms_set(model, self.head, self.bitfit_learning_rate_scale)
