"""The one engine factory: which per-example engine a DP step gets.

For the examples ``i`` of a (micro-)batch and the step's selections (the trainable set, or the
kernels a scorer scores), an engine computes either

* every per-example gradient ``g_i`` (*materialising*: :class:`~sparta_tf.per_example.engines.LayerwiseEngine`,
  per-layer rules, or :class:`~sparta_tf.per_example.engines.VectorizedEngine`, the whole model
  under ``tf.vectorized_map``), which a step needs when it transforms ``g_i`` before clipping
  (DP-SSGD's dropping) or keeps entry-wise ``|g_i|`` (SPARTA's entry-wise ``sum_abs`` scores); or
* only the norms ``||g_i||`` and the clipped sum ``S = sum_i c_i g_i`` (*book-keeping*,
  :class:`~sparta_tf.per_example.bookkeeping.BookkeepingEngine`): the same ``S`` without a
  model's worth of ``g_i``.

All of them are exact; they differ in speed and memory. ``engine="auto"`` means one thing: the
first of book-keeping, layer-wise, vectorized that gives the step what it needs and covers every
selected variable. Book-keeping is skipped when the step needs ``g_i`` (``materialise=True``) or a
variable is owned by several layers (tied weights: per-layer norms cannot be added); layer-wise
needs every variable owned by a leaf layer or a recurrent layer's cell; the vectorized engine
takes any model (recurrent layers aside) and is chosen with a warning that says why.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from sparta_tf.choices import ENGINES
from sparta_tf.per_example.bookkeeping import BookkeepingEngine, make_bookkeeping_engine
from sparta_tf.per_example.engines import LayerwiseEngine, VectorizedEngine
from sparta_tf.trainable import TrainableSet, VariableSelection

logger = logging.getLogger(__name__)



def as_selections(trainable) -> list[VariableSelection]:
    """A TrainableSet, selections or plain variables (each whole) as a list of selections."""
    if isinstance(trainable, TrainableSet):
        return list(trainable.selections)
    return [t if isinstance(t, VariableSelection) else VariableSelection(t) for t in trainable]


def make_engine(model: tf.keras.Model, trainable, engine: str = "auto", *, materialise: bool = False,
                views: int = 1, max_memory: int | None = None) -> BookkeepingEngine | LayerwiseEngine | VectorizedEngine:
    """The per-example engine of a step over ``trainable`` of ``model``.

    ``trainable``: a :class:`~sparta_tf.trainable.TrainableSet`, a list of selections, or a list
    of variables (each trained whole). ``engine``: ``"auto"`` (module doc), ``"bookkeeping"``,
    ``"layerwise"`` or ``"vectorized"``; a named engine that cannot cover the model is a
    ``ValueError`` (``UnsupportedLayerError`` for a layer no engine makes exact).
    ``materialise``: the step needs every ``g_i`` (the engine is then called as
    ``engine(x, y, loss_fn, valid).grads``); ``engine="bookkeeping"`` then means ``"auto"``, since
    book-keeping never forms ``g_i``. Without it, the step takes the clipped sum
    (:func:`~sparta_tf.per_example.bookkeeping.clipped_batch`, any engine). ``views``: rows per
    example (augmentation multiplicity, :mod:`sparta_tf.dp_step.views`); every engine then takes
    an example's gradient as the mean over its view rows. ``max_memory``: the bytes of output
    gradients the book-keeping engine's one-pass step may keep before it runs in two passes
    (:mod:`~sparta_tf.per_example.memory_budget`; None: the machine's default).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is not one of {ENGINES}")
    selections = as_selections(trainable)
    if engine == "vectorized":
        return VectorizedEngine(model, selections, views)
    if materialise and engine == "bookkeeping":
        engine = "auto"
    if engine in ("auto", "bookkeeping") and not materialise:
        bookkeeping, reason = make_bookkeeping_engine(model, selections, views, max_memory)
        if bookkeeping is not None:
            return bookkeeping
        if engine == "bookkeeping":
            raise ValueError(f"engine='bookkeeping' cannot handle this model: {reason}; use engine='auto'")
    plan, reason = LayerwiseEngine.plan_for(model, selections)
    if plan is not None:
        return LayerwiseEngine(model, selections, plan, views)
    if engine == "layerwise":
        raise ValueError(f"engine='layerwise' cannot handle this model: {reason}; use engine='auto'")
    logger.warning("per-example gradients: using tf.vectorized_map (%s)", reason)
    return VectorizedEngine(model, selections, views)
