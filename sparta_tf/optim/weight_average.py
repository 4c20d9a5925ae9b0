"""Weight averaging: an exponential moving average (EMA) of the DP-SGD iterates.

After every DP-SGD update (a gradient release; a selection epoch's score release moves no weight
and is not averaged), on the coordinates ``I`` of the current trainable set only::

    b_t   = min(decay, (1 + t) / (10 + t))          t = averaging updates so far (warm-up of the decay)
    A[I] <- A[I] + (1 - b_t) (W[I] - A[I])         then t <- t + 1

``A`` is a full-shape copy of each trainable variable ``W`` of the wrapped model, set to the
weights when training starts. Whole-variable selections are updated with ``assign_add``; row and
entry selections gather their compact coordinates and scatter the new averages back at them
(``scatter_nd_update``), as the :class:`~sparta_tf.optim.MaskedOptimizer` scatters its updates. A
coordinate outside the trainable set is never written, so every frozen coordinate of the averaged
model is bit-identical to the model's (and, for a sparse method, to the pre-trained weight).

The average is post-processing of the released noisy gradients: it costs no privacy.

Why not Keras' optimizer EMA (``use_ema=True``): Keras averages every variable inside
``apply_gradients``, which DP training never calls (the masked optimizer applies compact
gradients itself), and its ``avg = b avg + (1 - b) w`` on a frozen coordinate (``w = avg``) is not
bit-identical to ``w`` in floating point. The increment form above is exact there:
``A + (1 - b)(W - A) = A`` when ``W = A``.

Where the averages are used (:class:`AveragedWeights`, a Keras callback ``DPModel.fit`` adds):
with ``use_ema_weights=True`` validation during ``fit`` evaluates the averaged weights (swapped in
on ``on_test_begin``, the raw ones put back exactly on ``on_test_end``), and after ``fit`` the model
holds the averages (so ``evaluate``, ``save`` and ``export_for_serving`` use them);
:meth:`WeightAverage.use_raw` puts the raw weights back. The averages and ``t`` are part of
``DPModel.checkpoint_state()``: a resumed run continues the same average (after a ``fit`` that left
the averages in the model, call :meth:`WeightAverage.use_raw` before checkpointing the training state).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

from sparta_tf.backend import tf_variable, variable_key
from sparta_tf.optim.masked_optimizer import element_indices
from sparta_tf.trainable import VariableSelection


def check_decay(decay: float | None) -> None:
    """ValueError (one line) unless ``decay`` is None (no averaging) or in (0, 1)."""
    if decay is None:
        return
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        raise ValueError(f"ema={decay!r} must be a decay in (0, 1), e.g. 0.999, or None for no weight averaging")


class WeightAverage(tf.Module):
    """The EMA ``A`` of ``variables`` (the wrapped model's trainable variables); see the module doc.

    Create it under the distribution strategy's scope (``DPModel.compile`` does), before training."""

    def __init__(self, decay: float, variables: Sequence[tf.Variable]):
        super().__init__(name="weight_average")
        check_decay(decay)
        self.decay = float(decay)
        self._strategy = tf.distribute.get_strategy()
        self._model = _ModelWeights(tuple(variables))  # untracked: the model checkpoints its own variables
        self.averages = [
            tf.Variable(tf_variable(v).read_value(), trainable=False,
                        name="ema_" + variable_key(v).replace("/", "_").replace(":", "_"))
            for v in self._model.variables
        ]
        self.updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="ema_updates",
                                   aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._index = {id(v): k for k, v in enumerate(self._model.variables)}

    # ------------------------------------------------------------ the step

    def update(self, selections: Sequence[VariableSelection]) -> None:
        """One averaging update on the coordinates of ``selections`` (the trainable set the step just
        updated); in the traced step, in a replica or cross-replica context."""
        context = tf.distribute.get_replica_context()
        if context is None:
            self._update_cross_replica(tf.distribute.get_strategy(), selections)
        else:
            context.merge_call(lambda strategy: self._update_cross_replica(strategy, selections))

    def _update_cross_replica(self, strategy, selections) -> None:
        t = tf.cast(self.updates, tf.float32)
        rate = 1.0 - tf.minimum(tf.constant(self.decay, tf.float32), (1.0 + t) / (10.0 + t))  # 1 - b_t
        for selection in selections:
            average = self.averages[self._position(selection.variable)]
            strategy.extended.update(average, _update_fn(selection), args=(tf_variable(selection.variable), rate),
                                     group=False)
        self.updates.assign_add(1)

    def _position(self, variable) -> int:
        position = self._index.get(id(variable))
        if position is None:
            raise ValueError(f"variable {variable_key(variable)} has no average: it was not a trainable variable "
                             "of the model when the DP model was compiled; compile again")
        return position

    # ------------------------------------------------- where the averages are

    @property
    def holds_averages(self) -> bool:
        """True while the model's weights are the averages (:meth:`use_averages`)."""
        return self._model.raw is not None

    def start_from_weights(self) -> None:
        """``A <- W`` for every variable (before the first averaging update: the average starts from
        the weights training starts from, after any change a method's preparation made)."""
        with self._strategy.scope():
            for variable, average in zip(self._model.variables, self.averages):
                average.assign(tf_variable(variable).read_value())

    def use_averages(self) -> None:
        """The model's weights become the averages (exact copies); the raw weights are kept aside for
        :meth:`use_raw`. Nothing happens when the model holds the averages already."""
        if self._model.raw is not None:
            return
        with self._strategy.scope():
            self._model.raw = [tf.identity(tf_variable(v).read_value()) for v in self._model.variables]
            for variable, average in zip(self._model.variables, self.averages):
                tf_variable(variable).assign(average.read_value())

    def use_raw(self) -> None:
        """Puts the raw weights kept by :meth:`use_averages` back, bit for bit (nothing when they are in)."""
        if self._model.raw is None:
            return
        with self._strategy.scope():
            for variable, raw in zip(self._model.variables, self._model.raw):
                tf_variable(variable).assign(raw)
        self._model.raw = None


@dataclasses.dataclass
class _ModelWeights:
    """The averaged model's variables and, while the model holds the averages, its raw weights: held
    where ``tf.Module`` does not track them (a checkpoint of the weight average holds the averages and
    the counter, not a second copy of the model)."""

    variables: tuple
    raw: list | None = None


def _update_fn(selection: VariableSelection):
    """``A[I] <- A[I] + rate (W[I] - A[I])`` on one device's copies (``strategy.extended.update``)."""
    indices = element_indices(selection)

    def update(average, weight, rate):
        rate = tf.cast(rate, average.dtype)
        if indices is None:
            return average.assign_add(rate * (tf.convert_to_tensor(weight) - average.read_value()))
        old = tf.gather_nd(average, indices)
        return average.scatter_nd_update(indices, old + rate * (tf.gather_nd(weight, indices) - old))

    return update


class AveragedWeights(tf.keras.callbacks.Callback):
    """Where ``DPModel.fit`` uses the averages of ``average`` (a :class:`WeightAverage`).

    ``on_train_begin``: the raw weights are in (a model holding the averages after an earlier ``fit``
    trains on from its raw weights); before the first averaging update the average starts from the
    weights. With ``use_ema_weights``: the averages are swapped in for validation (``on_test_begin`` /
    ``on_test_end``) and stay in after training (``on_train_end``)."""

    def __init__(self, average: WeightAverage, use_ema_weights: bool = True):
        super().__init__()
        self.average = average
        self.use_ema_weights = bool(use_ema_weights)
        self._training = False

    def on_train_begin(self, logs=None):
        self.average.use_raw()
        if int(self.average.updates.numpy()) == 0:
            self.average.start_from_weights()
        self._training = True

    def on_test_begin(self, logs=None):
        if self._training and self.use_ema_weights:
            self.average.use_averages()

    def on_test_end(self, logs=None):
        if self._training and self.use_ema_weights:
            self.average.use_raw()

    def on_train_end(self, logs=None):
        self._training = False
        if self.use_ema_weights:
            self.average.use_averages()
