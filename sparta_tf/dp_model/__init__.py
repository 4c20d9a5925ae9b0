"""``DPModel``: DP-SGD for any Keras model through plain ``model.fit``.

* :mod:`sparta_tf.dp_model.model`: :class:`DPModel` (the Keras model; its ``train_step`` composes
  the parts of :mod:`sparta_tf.dp_step`);
* :mod:`sparta_tf.dp_model.fit_inputs`: what ``fit`` feeds the step (Poisson batches) and the
  checks before the first step.

How its steps are charged to its ledger is :mod:`sparta_tf.privacy.charging`'s.
"""

from sparta_tf.dp_model.model import SAMPLING_MODES, DPModel

__all__ = ["DPModel", "SAMPLING_MODES"]
