"""The per-example engine of a DP step: materialised ``g_i``, or only their clipped sum.

For the examples ``i`` of a (micro-)batch and the step's selections (the trainable set, or the
kernels a scorer scores), an engine computes either

* every per-example gradient ``g_i`` (a *materialising* engine,
  :func:`~sparta_tf.per_example.engines.make_engine`: layer-wise rules or ``tf.vectorized_map``),
  which a step needs when it transforms ``g_i`` before clipping (DP-SSGD's dropping) or keeps
  entry-wise ``|g_i|`` (SPARTA's entry-wise ``sum_abs`` scores); or
* only the clipped sum ``S = sum_i c_i g_i`` and the norms ``||g_i||`` (book-keeping,
  :mod:`sparta_tf.per_example.bookkeeping`): the same ``S`` without a model's worth of ``g_i``.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from sparta_tf.per_example import make_engine
from sparta_tf.per_example.bookkeeping import make_clipping_engine
from sparta_tf.trainable import VariableSelection


def choose_engine(model: tf.keras.Model, selections: Sequence[VariableSelection], engine: str,
                  materialise: bool):
    """The engine of a step over ``selections``: a materialising one when ``materialise`` (the
    step needs ``g_i`` themselves; ``engine="bookkeeping"`` then means ``"auto"``), else the
    clipping engine ``engine`` names (``"auto"``: book-keeping where every variable allows it)."""
    if materialise:
        return make_engine(model, selections, "auto" if engine == "bookkeeping" else engine)
    return make_clipping_engine(model, selections, engine)
