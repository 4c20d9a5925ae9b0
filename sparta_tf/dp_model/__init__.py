"""``DPModel``: DP-SGD for any Keras model through plain ``model.fit``.

* :mod:`sparta_tf.dp_model.model`: :class:`DPModel` (the Keras model; its ``train_step`` composes
  the parts of :mod:`sparta_tf.dp_step`);
* :mod:`sparta_tf.dp_model.fit_inputs`: what ``fit`` feeds the step (Poisson batches) and the
  checks before the first step;
* :mod:`sparta_tf.dp_model.ledger_callback`: the privacy callback that charges the ledger.
"""

from sparta_tf.dp_model.model import SAMPLING_MODES, DPModel

__all__ = ["DPModel", "SAMPLING_MODES"]
