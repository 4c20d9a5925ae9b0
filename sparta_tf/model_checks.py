"""Checks that a Keras model admits per-example gradients (and so DP-SGD).

DP-SGD bounds one example's influence by clipping *its* gradient. That
holds only if, in training mode, the output (and so the gradient) of example
``j`` does not depend on any other example of the batch, and if the data
leave no trace outside the clipped, noised update. Two checks enforce this:

1. **By class** (:func:`reject_batch_mixing_layers`, at ``DPModel``
   construction): every BatchNormalization variant that is trainable. A
   layer counts as BatchNorm when its class or any base class has
   ``BatchNorm`` in its name (:func:`is_batch_normalization`), which covers
   Keras' ``BatchNormalization``, ``SyncBatchNormalization``,
   ``tf.compat.v1.keras.layers.BatchNormalization`` (all derived from the
   shared ``BatchNormalizationBase``, not from ``BatchNormalization``) and
   third-party subclasses. Frozen BatchNorm (``trainable = False``) runs in
   inference mode with fixed statistics (Keras 2 and Keras 3): allowed.
2. **By behaviour** (:func:`probe_batch_mixing`, on a few real examples
   before the first DP step): with every variable and the random seed reset
   between calls, the training-mode outputs of examples ``1..k`` must not
   change when example ``0`` is replaced (any layer computing batch
   statistics, with or without gradient, fails this); and a training-mode
   call must not change any floating-point non-trainable variable (a layer
   that writes statistics of the data into its state, e.g. moving averages,
   would leak them un-noised into the exported model).

Not caught: a layer whose cross-example dependence is invisible on the probe
batch (e.g. it mixes only batches larger than the probe's, or only inputs
that differ from the probe's in some other way), or whose randomness cannot
be replayed (the behaviour probe then reports that it could not decide and
only the class check applies), and mixing inside custom training loops
outside the model's ``call``.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from sparta_tf.backend import variable_key
from sparta_tf.keras_layers import all_layers

logger = logging.getLogger(__name__)

PROBE_EXAMPLES = 4
PROBE_SEED = 1234
PROBE_RTOL = 1e-4  # relative change of another example's output that counts as mixing


class NotPerExampleSafeError(ValueError):
    """The model mixes examples of a batch, so per-example DP does not hold."""


def is_batch_normalization(layer) -> bool:
    """True for every BatchNormalization variant (its class or a base class is named ``*BatchNorm*``)."""
    return any("BatchNorm" in cls.__name__ for cls in type(layer).__mro__)


ROOT_SCOPE_NAME = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*$")
"""TensorFlow's rule for a name scope opened at the top of a traced function, which a model's
``__call__`` opens with the model's name."""


def reject_unscopable_name(model: tf.keras.Model) -> None:
    """A one-line ValueError when TensorFlow would refuse the model's name as a root name scope (a name
    starting with ``_``, for example): Keras's own ``fit`` fails on it too, deep inside the traced step."""
    if not ROOT_SCOPE_NAME.match(model.name):
        raise ValueError(f"the model's name {model.name!r} is not one TensorFlow accepts as a name scope (it must "
                         "start with a letter, a digit or '.'); rename it, e.g. tf.keras.Model(inputs, outputs, "
                         f"name={model.name.lstrip('_-/>') or 'model'!r})")


def reject_batch_mixing_layers(model: tf.keras.Model) -> None:
    """Raises :class:`NotPerExampleSafeError` for trainable BatchNormalization layers (any variant).

    In training mode BatchNorm normalises each example with the statistics of
    the whole batch, so one example's gradient depends on every other example
    and clipping per-example gradients no longer bounds any single example's
    influence: the DP guarantee would be void.
    """
    found = [layer for layer in all_layers(model) if is_batch_normalization(layer) and layer.trainable]
    if found:
        first = found[0]
        which = (f"layer {first.name!r} ({type(first).__name__}) is" if len(found) == 1 else
                 f"{len(found)} layers ({first.name!r}, {type(first).__name__}, and {len(found) - 1} more) are")
        them = "it" if len(found) == 1 else "them"
        raise NotPerExampleSafeError(
            f"{which} BatchNormalization in training mode, which mixes the examples of a batch and breaks "
            f"per-example clipping and the DP guarantee; convert {them} with "
            "sparta_tf.models.replace_batchnorm(model, \"groupnorm\") (GroupNormalization, same weights otherwise) "
            f"or freeze {them} with replace_batchnorm(model, \"freeze\") (trainable = False: inference mode)"
        )


def adapted_state_caveat(model: tf.keras.Model) -> str | None:
    """A ledger caveat naming ``model``'s preprocessing layers whose state ``adapt`` computes from data
    (Normalization's mean and variance, Discretization's bins, a lookup's vocabulary), None without any.
    That state is part of the starting model, which the guarantee assumes public; on Keras 2 only the
    layers adapted so far count (``is_adapted``), Keras 3 does not say, so every layer that can be does."""
    found = [layer.name for layer in all_layers(model)
             if callable(getattr(layer, "adapt", None)) and getattr(layer, "is_adapted", True)]
    if not found:
        return None
    return (f"the model's preprocessing layers {found[:3]}{' and more' if len(found) > 3 else ''} hold state that "
            "adapt() computes from data (statistics, bins, a vocabulary), which DP training does not protect; the "
            "guarantee assumes it was computed from public data, not from the private examples")


# Kept for callers of the earlier name.
reject_batchnorm_in_training_mode = reject_batch_mixing_layers


def first_examples(t, count: int = PROBE_EXAMPLES):
    """The first ``count`` examples of arrays or tensors (any structure), as tensors: what a probe runs on."""
    return tf.nest.map_structure(lambda a: tf.convert_to_tensor(a[:count]), t)


def _replaced_first(x, donor_index: int):
    """``x`` with example 0 replaced by a far-away version of example ``donor_index``."""
    def replace(t):
        t = tf.convert_to_tensor(t)
        if t.dtype.is_floating:
            other = t[donor_index] * 3.0 + 1.0
        else:  # ids / integer features: another example's values
            other = t[donor_index]
        return tf.concat([other[None], t[1:]], axis=0)
    return tf.nest.map_structure(replace, x)


def _outputs(model, x, snapshot) -> list[np.ndarray]:
    for variable, value in snapshot:
        variable.assign(value)
    tf.random.set_seed(PROBE_SEED)
    return [np.asarray(o) for o in tf.nest.flatten(model(x, training=True))]


def _changed_state(model, snapshot) -> list[str]:
    trainable = {id(v) for v in model.trainable_variables}
    return [variable_key(v) for v, before in snapshot
            if id(v) not in trainable and tf.as_dtype(v.dtype).is_floating and not np.array_equal(v.numpy(), before)]


def _differs(a: list[np.ndarray], b: list[np.ndarray], rows: slice) -> bool:
    for left, right in zip(a, b):
        left, right = left[rows], right[rows]
        scale = np.maximum(np.abs(left), np.abs(right)).max(initial=0.0) + 1e-12
        if np.abs(left - right).max(initial=0.0) > PROBE_RTOL * scale:
            return True
    return False


def probe_batch_mixing(model: tf.keras.Model, x) -> bool:
    """Checks on real inputs ``x`` (a batch of >= 2 examples) that training mode does not mix examples.

    Raises :class:`NotPerExampleSafeError` when it does (see the module doc);
    returns False when the probe could not decide (the model's randomness
    cannot be replayed), True when it passed. Every variable is restored.
    """
    x = first_examples(x)
    batch = int(tf.shape(tf.nest.flatten(x)[0])[0])
    if batch < 2:
        return False
    snapshot = [(v, v.numpy()) for v in model.variables if hasattr(v, "numpy")]  # not a lookup's vocabulary
    global_seed = context.global_seed()
    try:
        first = _outputs(model, x, snapshot)
        written = _changed_state(model, snapshot)
        if written:
            raise NotPerExampleSafeError(
                f"a training-mode call of the model changes the non-trainable variables {written[:3]}: it "
                "writes statistics of the private data into the model's state (e.g. moving averages) "
                "outside the clipped, noised update; freeze the layers that own them (layer.trainable = False)"
            )
        if _differs(first, _outputs(model, x, snapshot), slice(None)):
            logger.warning("per-example safety probe: the model's training-mode output is not reproducible "
                           "under a fixed seed, so cross-example mixing was checked by layer class only")
            return False
        if _differs(first, _outputs(model, _replaced_first(x, 1), snapshot), slice(1, None)):
            raise NotPerExampleSafeError(
                "in training mode the model's output for one example changes when another example of the "
                "batch changes: some layer mixes the examples of a batch (batch statistics), which breaks "
                "per-example clipping and the DP guarantee; replace or freeze that layer"
            )
        return True
    finally:
        for variable, value in snapshot:
            variable.assign(value)
        tf.random.set_seed(global_seed)


def probe_loss_mixing(loss_fn, model: tf.keras.Model, x, y) -> None:
    """Checks on real examples ``x, y`` (>= 2) that the per-example loss ``loss_fn(y, predictions) -> [B]`` keeps
    examples apart: one value per example, and the others' unchanged when example 0's prediction and label
    change. A loss of batch statistics (a contrastive or InfoNCE loss, predictions centred on the batch mean)
    lets one example move every other example's gradient, so its clipped term: the sensitivity is then up to
    ``2 C B``, not ``C``. Raises :class:`NotPerExampleSafeError`."""
    x, y = first_examples(x), first_examples(y)
    predictions = model(x, training=False)
    batch = int(tf.shape(tf.nest.flatten(predictions)[0])[0])
    losses = loss_fn(y, predictions)
    if losses.shape.rank != 1 or int(losses.shape[0]) != batch:
        raise NotPerExampleSafeError(
            f"the loss returned shape {losses.shape.as_list()} for {batch} examples; DP-SGD clips each example's "
            "gradient, so the loss must give one value per example (y_true, y_pred) -> [batch]: pass a Keras loss "
            "or a function without reduction over the batch")
    if batch < 2:
        return
    moved = loss_fn(_replaced_first(y, 1), _replaced_first(predictions, 1))
    if _differs([np.asarray(losses)], [np.asarray(moved)], slice(1, None)):
        raise NotPerExampleSafeError(
            "the loss of one example changes when another example's prediction or label changes: it mixes the "
            "examples of a batch (batch statistics, a contrastive loss), which breaks per-example clipping and the "
            "DP guarantee; use a loss of each example's own prediction and label")

