"""What :class:`~sparta_tf.DPModel` saves and restores: the wrapped Keras model's files and weights (Keras's
saving and callbacks act on the model you built), and the state a resumable checkpoint holds."""

from __future__ import annotations

import tensorflow as tf

from sparta_tf.random_layer_state import data_independent_random_state


class WrappedModelSaving:
    """Saving, weights and checkpoint state of a DP model (a mixin of :class:`~sparta_tf.DPModel`, which holds
    ``model``, ``dp_step``, the noise seed, the masked optimizer and the weight average)."""

    def save(self, filepath, *args, **kwargs):
        """Saves the wrapped Keras model (``self.model.save``): the file loads with
        ``keras.models.load_model`` into the model you built, without sparta_tf. The DP state (step
        counter, noise seed, optimizer slots, ledger) is not in it: a resumable run keeps that in
        ``make_private(run_dir=...)``'s checkpoints (:mod:`sparta_tf.checkpointing`)."""
        return self.model.save(filepath, *args, **kwargs)

    def export(self, filepath, *args, **kwargs):
        """Exports the wrapped Keras model (``self.model.export``), its random layers' draw counters at zero
        (:func:`sparta_tf.random_layer_state.data_independent_random_state`); the DP state is not in it. For
        TF Serving with preprocessing baked in: :func:`sparta_tf.export_for_serving`."""
        with data_independent_random_state(self.model):
            return self.model.export(filepath, *args, **kwargs)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """As Keras's, but a SavedModel of the DP model itself is refused: it would hold the DP state (the
        secret noise seed, the step counter, the loss trackers' example counts)."""
        if save_type == "savedmodel":  # TensorFlow's SaveType is a str enum
            raise ValueError(f"a SavedModel of {type(self).__name__} would hold the run's secret noise seed and "
                             "counts of private examples; save or export the model you built (dp.model, dp.save, "
                             "dp.export) or use sparta_tf.export_for_serving")
        return super()._trackable_children(save_type, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        """The wrapped model's weights (``self.model.save_weights``), loadable by its ``load_weights``
        (so ``ModelCheckpoint(save_weights_only=True)`` writes a file the model you built can read)."""
        return self.model.save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Loads weights saved by :meth:`save_weights` (or the wrapped model's own) into the wrapped model."""
        return self.model.load_weights(filepath, *args, **kwargs)

    def get_weights(self):
        """The wrapped model's weights (what ``EarlyStopping(restore_best_weights=True)`` keeps); the DP
        step counter and noise seed are not weights of the model and are never rewound."""
        return self.model.get_weights()

    def set_weights(self, weights):
        """Sets the wrapped model's weights (see :meth:`get_weights`)."""
        return self.model.set_weights(weights)

    def checkpoint_state(self) -> dict[str, tf.Module]:
        """What a resumable checkpoint must hold: weights, optimizer state, step counters, seed.

        ``{"model", "dp_step", "noise_seed", "public_seed", "iterations", "masked_optimizer", "weight_average",
        "correlated_noise"}`` (``masked_optimizer`` only after ``compile``, ``weight_average`` with ``ema``,
        ``correlated_noise`` with ``bands > 1``: BandMF's buffered noise), for
        ``tf.train.Checkpoint``. The privacy ledger is not a ``tf.Module``: save ``ledger.to_json()``
        beside the checkpoint and restore it (``PrivacyLedger.from_json``) with it; ``fit`` refuses a
        ``dp_step`` its ledger does not cover.
        """
        state = {"model": self.model, "dp_step": self.dp_step, "noise_seed": self._noise_seed,
                 "public_seed": self._public_seed}
        if self._masked_optimizer is not None:
            state["iterations"] = self.optimizer.iterations
            state["masked_optimizer"] = self._masked_optimizer
        if self.weight_average is not None:
            state["weight_average"] = self.weight_average
        if self.correlated_noise is not None:
            state["correlated_noise"] = self.correlated_noise
        return state
