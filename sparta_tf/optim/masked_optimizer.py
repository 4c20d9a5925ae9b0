"""Masked DP-SGD optimizer: updates only the trainable coordinates.

Gradients arrive in the *compact* form of a :class:`~sparta_tf.trainable.TrainableSet`
(one tensor per selection holding only its trainable coordinates). For
selection ``s`` with compact gradient ``g_s``, learning rate ``lr_t`` (a
float or a Keras schedule evaluated at the step) times the selection's
``learning_rate_scale``:

* SGD, momentum ``mu`` (Keras' convention)::

      m_s <- mu m_s - lr g_s;   d_s = -m_s   (Nesterov: d_s = -(mu m_s - lr g_s));   no momentum: d_s = lr g_s

* Adam (Keras' convention, ``t`` = step + 1)::

      m_s <- m_s + (1 - b1)(g_s - m_s);   v_s <- v_s + (1 - b2)(g_s^2 - v_s)
      d_s = lr sqrt(1 - b2^t) / (1 - b1^t) * m_s / (sqrt(v_s) + eps)

* decoupled weight decay ``wd`` (if the Keras optimizer has one), on
  trainable coordinates only: ``d_s += lr wd W_s``;

then ``W[s] <- W[s] - d_s``: dense selections with ``assign_sub``; row and
entry selections with ``scatter_nd_sub`` at their coordinates (an in-place
scatter, so frozen coordinates are never written). On Keras 3 the update goes to
the ``tf.Variable`` inside the ``keras.Variable`` (:func:`sparta_tf.backend.tf_variable`),
which has ``scatter_nd_sub``; the Keras 3 optimizer is read for its hyper-parameters
only, as on Keras 2.

With a step's keep mask ``1_s`` (a gradient filter that drops coordinates, e.g. DP-SSGD's
gradient dropping; see :mod:`sparta_tf.dp_step.keep`), dropped coordinates move neither their
weight nor their state: ``d_s <- 1_s (.) d_s`` and ``m_s, v_s`` keep their old values outside
``1_s``, so a dropped coordinate is exactly as if the step had not happened for it, with
momentum too.

Optimizer state (``m_s``, ``v_s``) has the compact shape: it exists only for
trainable coordinates. When the trainable set changes (SPARTA's phases), the
state of selections that stay identical is kept and new selections start
from zero.

The hyper-parameters come from an ordinary ``tf.keras.optimizers.SGD`` or
``Adam`` (what ``DPModel.compile`` receives): its learning rate or schedule,
``iterations`` counter (incremented here), momentum/Nesterov or betas/epsilon
and weight decay. Keras callbacks that change ``model.optimizer.learning_rate``
therefore keep working.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
import tensorflow as tf

from sparta_tf.backend import learning_rate, tf_variable, variable_key
from sparta_tf.trainable import TrainableSet, VariableSelection

LearningRateSchedule = tf.keras.optimizers.schedules.LearningRateSchedule

_UNSUPPORTED_OPTIONS = ("clipnorm", "clipvalue", "global_clipnorm")


def _optimizer_kind(optimizer) -> str:
    if isinstance(optimizer, tf.keras.optimizers.SGD):
        return "sgd"
    if isinstance(optimizer, tf.keras.optimizers.Adam):
        if getattr(optimizer, "amsgrad", False):
            raise ValueError("Adam(amsgrad=True) is not supported by the masked optimizer; use amsgrad=False")
        return "adam"
    raise ValueError(
        f"optimizer {type(optimizer).__name__} is not supported for DP training; use "
        "tf.keras.optimizers.SGD (paper default: momentum=0.9) or tf.keras.optimizers.Adam"
    )


def _without_loss_scaling(optimizer):
    """The optimizer inside a Keras ``LossScaleOptimizer`` (what ``compile`` wraps around the optimizer
    under the ``mixed_float16`` policy), else ``optimizer``.

    A DP step does not scale its loss: per-example losses are summed, not averaged over the
    batch, so output gradients keep a per-example size, and the clipped sum is computed in
    float32 (:mod:`sparta_tf.precision`). A dynamic loss scale would be worse than useless here:
    it moves with whether private examples overflowed, a data-dependent state outside the
    noised release."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and "LossScale" in type(optimizer).__name__:
        return inner
    return optimizer


def _check_options(optimizer) -> None:
    for option in _UNSUPPORTED_OPTIONS:
        if getattr(optimizer, option, None):
            raise ValueError(
                f"optimizer {option}={getattr(optimizer, option)} would act on the noisy gradient, "
                "not per example; remove it (DPModel clips per example with clip_norm)"
            )
    if getattr(optimizer, "use_ema", False):
        raise ValueError("optimizer use_ema=True: Keras' EMA averages in apply_gradients, which DP training does not "
                         "call; remove it and average with make_private(..., ema=0.999) / DPModel(..., ema=0.999) "
                         "(sparta-train: training.ema)")


def _selection_key(selection: VariableSelection) -> str:
    """Stable name of a selection's optimizer state (same across processes)."""
    indices = selection.flat_indices
    digest = 0 if indices is None else zlib.crc32(np.ascontiguousarray(indices).tobytes())
    name = variable_key(selection.variable).replace("/", "_").replace(":", "_")
    return f"{name}__{selection.kind}_{selection.size}_{digest:08x}"


def selection_keys(selections: Sequence[VariableSelection]) -> list[str]:
    """The stable, distinct names of the selections' state (optimizer slots, correlated noise): equal for
    an unchanged selection in another trainable set or process, so its state is kept or restored."""
    keys: list[str] = []
    for selection in selections:
        key = _selection_key(selection)
        while key in keys:  # distinct variables with the same name (nested models)
            key += "_"
        keys.append(key)
    return keys


class MaskedOptimizer(tf.Module):
    """Applies compact gradients of a trainable set (see module doc)."""

    def __init__(self, keras_optimizer: tf.keras.optimizers.Optimizer):
        super().__init__(name="masked_optimizer")
        keras_optimizer = _without_loss_scaling(keras_optimizer)
        self.kind = _optimizer_kind(keras_optimizer)
        _check_options(keras_optimizer)
        self.keras_optimizer = keras_optimizer
        self.slots: dict[str, list[tf.Variable]] = {}
        self._selections: list[VariableSelection] = []
        self._keys: list[str] = []

    # ---------------------------------------------------------------- state

    def _slot_names(self) -> tuple[str, ...]:
        if self.kind == "adam":
            return ("m", "v")
        return ("momentum",) if self._momentum() > 0 else ()

    def build(self, trainable_set: TrainableSet | Sequence[VariableSelection]) -> None:
        """Creates zero state for new selections; keeps the state of unchanged ones."""
        selections = list(trainable_set)
        kept: dict[str, list[tf.Variable]] = {}
        keys = selection_keys(selections)
        for selection, key in zip(selections, keys):
            if key in self.slots:
                kept[key] = self.slots[key]
                continue
            kept[key] = [
                tf.Variable(tf.zeros(selection.compact_shape, selection.variable.dtype),
                            trainable=False, name=f"{key}_{slot}")
                for slot in self._slot_names()
            ]
        self.slots = kept
        self._selections = selections
        self._keys = keys

    @property
    def selections(self) -> list[VariableSelection]:
        """The selections of the last :meth:`build` (the trainable set ``apply`` updates)."""
        return list(self._selections)

    @property
    def state_size(self) -> int:
        """Number of scalars of optimizer state (for tests and reports)."""
        return sum(int(np.prod(v.shape.as_list())) for slots in self.slots.values() for v in slots)

    # -------------------------------------------------------- hyper-parameters

    def _momentum(self) -> float:
        return float(getattr(self.keras_optimizer, "momentum", 0.0) or 0.0)

    @property
    def workload_momentum(self) -> float:
        """The heavy-ball momentum of the linear workload the updates are (SGD's); 0 for Adam, whose
        updates are not linear in the gradients."""
        return self._momentum() if self.kind == "sgd" else 0.0

    def learning_rate(self) -> tf.Tensor:
        """The learning rate of the current step (schedules evaluated at ``iterations``)."""
        lr = learning_rate(self.keras_optimizer)
        if isinstance(lr, LearningRateSchedule):
            return tf.cast(lr(self.keras_optimizer.iterations), tf.float32)
        return tf.cast(tf.convert_to_tensor(lr), tf.float32)

    # ------------------------------------------------------------------ apply

    def apply(self, grads: Sequence[tf.Tensor], keep: Sequence[tf.Tensor] | None = None) -> None:
        """One update with ``grads[k]`` the compact gradient of selection ``k``; ``keep[k]`` (boolean,
        compact shape), when given, the coordinates this step updates (see the module doc)."""
        if len(grads) != len(self._selections):
            raise ValueError(f"{len(grads)} gradients for {len(self._selections)} selections; call build() first")
        context = tf.distribute.get_replica_context()
        if context is None:
            self._apply_cross_replica(tf.distribute.get_strategy(), grads, keep)
        else:
            context.merge_call(self._apply_cross_replica, args=(grads, keep))

    def _apply_cross_replica(self, strategy, grads, keep=None):
        lr = self.learning_rate()
        step = tf.cast(self.keras_optimizer.iterations + 1, tf.float32)
        masks = [None] * len(grads) if keep is None else list(keep)
        for selection, key, grad, mask in zip(self._selections, self._keys, grads, masks):
            slots = self.slots[key]
            scaled_lr = lr * selection.learning_rate_scale
            if mask is None:
                update, args = self._update_fn(selection), (grad, scaled_lr, step, *slots)
            else:
                update, args = self._kept_update_fn(selection), (grad, mask, scaled_lr, step, *slots)
            strategy.extended.update(tf_variable(selection.variable), update, args=args, group=False)
        self.keras_optimizer.iterations.assign_add(1)

    def _update_fn(self, selection: VariableSelection):
        indices = element_indices(selection)

        def update(variable, grad, lr, step, *slots):
            grad = tf.cast(tf.convert_to_tensor(grad), variable.dtype)  # the noisy release, post-processed
            lr = tf.cast(lr, variable.dtype)
            step = tf.cast(step, variable.dtype)
            decrement = self._decayed_decrement(variable, indices, grad, lr, step, slots)
            return _subtract(variable, indices, decrement)

        return update

    def _kept_update_fn(self, selection: VariableSelection):
        """The update of :meth:`_update_fn` on the kept coordinates only (weights and state)."""
        indices = element_indices(selection)

        def update(variable, grad, keep, lr, step, *slots):
            grad = tf.convert_to_tensor(grad)
            keep = tf.convert_to_tensor(keep)
            before = [tf.identity(s.read_value()) for s in slots]
            decrement = self._decayed_decrement(variable, indices, grad, lr, step, slots)
            decrement = tf.where(keep, decrement, tf.zeros_like(decrement))
            for slot, old in zip(slots, before):
                slot.assign(tf.where(keep, slot.read_value(), old))
            return _subtract(variable, indices, decrement)

        return update

    def _decayed_decrement(self, variable, element_indices, grad, lr, step, slots):
        """``d_s`` (:meth:`_decrement`) plus decoupled weight decay ``lr wd W_s``."""
        decrement = self._decrement(grad, lr, step, slots)
        weight_decay = getattr(self.keras_optimizer, "weight_decay", None)
        if weight_decay:
            current = variable if element_indices is None else tf.gather_nd(variable, element_indices)
            decrement += lr * weight_decay * tf.reshape(current, tf.shape(decrement))
        return decrement

    def _decrement(self, grad, lr, step, slots):
        opt = self.keras_optimizer
        if self.kind == "adam":
            m, v = slots
            m.assign_add((grad - m) * (1.0 - opt.beta_1))
            v.assign_add((tf.square(grad) - v) * (1.0 - opt.beta_2))
            corrected = lr * tf.sqrt(1.0 - tf.pow(opt.beta_2, step)) / (1.0 - tf.pow(opt.beta_1, step))
            return corrected * m / (tf.sqrt(v) + opt.epsilon)
        if not slots:
            return lr * grad
        (momentum_slot,) = slots
        mu = self._momentum()
        momentum_slot.assign(mu * momentum_slot - lr * grad)
        if opt.nesterov:
            return -(mu * momentum_slot - lr * grad)
        return -tf.identity(momentum_slot)


def _subtract(variable, element_indices, decrement):
    """``W[s] <- W[s] - d_s``: ``assign_sub`` for a dense selection, else an in-place scatter."""
    if element_indices is None:
        return variable.assign_sub(decrement)
    return variable.scatter_nd_sub(element_indices, tf.reshape(decrement, [-1]))


def element_indices(selection: VariableSelection) -> tf.Tensor | None:
    """``[k, rank]`` indices of the selection's coordinates (compact order); None when dense."""
    flat = selection.flat_indices
    if flat is None:
        return None
    shape = selection.shape
    dtype = tf.int32 if int(np.prod(shape)) < 2**31 else tf.int64
    unravelled = tf.unravel_index(tf.constant(flat, dtype), tf.constant(shape, dtype))
    return tf.transpose(unravelled)
