"""Keras callbacks that run a fine-tuning method inside ``DPModel.fit``.

:class:`MethodCallback` drives any :class:`sparta_tf.methods.Method` through
its phases (:mod:`sparta_tf.methods.base`): at the first epoch of a phase it
calls ``method.enter`` (set the trainable set, or begin scoring), after the
last epoch ``method.leave`` (e.g. SPARTA's top-k and mask save), and it
labels the ledger's steps with the phase name. :class:`SpartaCallback` is
SPARTA (Algorithm 1) with its options.

Learning-rate schedules: a selection epoch updates no weight, so it does not
advance ``optimizer.iterations``; a schedule of a run with a selection epoch
must span the *update* steps, ``(T - 1) * steps_per_epoch``
(``PrivacyPlan.update_steps``), to reach its end at the last update.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from sparta_tf.methods import Method, make_method
from sparta_tf.privacy.plan import TrainingPhase


class MethodCallback(tf.keras.callbacks.Callback):
    """Runs fine-tuning ``method`` in ``DPModel.fit``.

    Args:
      method: a :class:`~sparta_tf.methods.Method`, or a name from
        :data:`sparta_tf.methods.METHODS` built with ``options``.
      **options: the method's options (see each method's ``options``), e.g.
        ``warmup_epochs``, ``density``, ``score``, ``granularity``,
        ``density_overrides``, ``mask`` for sparta; ``full_epochs`` for
        x_bitfit; and for every method ``head``, ``head_learning_rate_scale``,
        ``mask_dir`` (where masks are saved), ``verbose``.
    """

    def __init__(self, method: str | Method, **options: Any):
        super().__init__()
        if isinstance(method, Method):
            if options:
                raise ValueError("pass options to the Method itself, not to MethodCallback")
            self.method = method
        else:
            self.method = make_method(method, **options)
        self.phase: TrainingPhase | None = None
        self._epochs = 0
        self._begun = False  # begin() was called for the coming fit (a resumed one)

    @property
    def mask_selections(self):
        """The method's mask once known (sparse methods), else None."""
        return getattr(self.method, "mask_selections", None)

    def on_train_begin(self, logs=None):
        from sparta_tf.dp_model import DPModel  # local: dp_model imports nothing from here

        if not isinstance(self.model, DPModel):
            raise TypeError(f"{type(self).__name__} needs a sparta_tf.DPModel; wrap your model with DPModel(...)")
        if not self._begun:
            self.begin(self.model, self.params.get("epochs", 0))
        self._begun = False  # a later fit with this callback starts afresh

    def begin(self, dp, epochs: int, first_epoch: int = 0) -> None:
        """Prepares the method for a fit of ``epochs`` epochs that starts at epoch ``first_epoch``.

        ``fit`` calls it with ``first_epoch=0``; to resume a fit at
        ``initial_epoch=k`` call ``begin(dp, epochs, k)`` first, then restore
        the checkpoint and ``fit(..., initial_epoch=k)``: the method then reloads
        its saved mask instead of choosing (and paying for) it again.

        Raises ValueError (one line) when ``dp`` is not the DP model the method
        runs on or the method's preparation did not run for it
        (:meth:`~sparta_tf.methods.Method.check_ready`): DP-SSGD needs
        ``method.make_dp_model``, DP-FROST and pruning DP-SSGD need
        ``method.prepare(dp, x, y, loss, plan)`` before ``fit``.
        """
        self.set_model(dp)
        self._epochs = epochs
        self.method.check_ready(dp)  # refuses a DP model the method was not built or prepared for
        self.method.phases(epochs)  # refuses a schedule that does not fit
        self.method.start(dp, epochs, first_epoch)
        self.phase = None
        self._begun = True

    def on_epoch_begin(self, epoch, logs=None):
        phase = self.method.phase_of(epoch, self._epochs)
        dp = self.model
        if dp.privacy_callback is not None:
            dp.privacy_callback.phase = phase.name
        if phase == self.phase:
            return
        self.method.enter(phase, dp)
        self.phase = phase
        if self.method.verbose:
            fraction = dp.trainable_set.fraction_of(dp.model)
            what = "no weight updates" if not phase.updates else f"{fraction:.2%} of the parameters trainable"
            print(f"{self.method.name}: {phase.name} phase ({what})", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        last_of_phase = epoch + 1 >= self._epochs or self.method.phase_of(epoch + 1, self._epochs) != self.phase
        if last_of_phase and self.phase is not None:
            self.method.leave(self.phase, self.model)
            self.phase = None  # the next epoch enters the following phase
        if logs is not None:
            logs["trainable_fraction"] = self.model.trainable_set.fraction_of(self.model.model)


class SpartaCallback(MethodCallback):
    """SPARTA (Makni et al., KDD 2025, Algorithm 1) inside ``DPModel.fit``.

    ``score="sum_abs"`` (paper) or ``"abs_sum"`` (authors' code);
    ``granularity="entry"`` gives the no-grouping ablation;
    ``warmup_epochs`` defaults to ``T / 5`` (the paper's 10 of 50). Other
    options as :class:`MethodCallback`.
    """

    def __init__(self, *, warmup_epochs: int | None = None, density: float = 0.2, score: str = "sum_abs",
                 granularity: str = "row", **options: Any):
        super().__init__("sparta", warmup_epochs=warmup_epochs, density=density, score=score,
                         granularity=granularity, **options)


class NonFiniteTrainingError(RuntimeError):
    """Training produced a non-finite loss or weight; the model is unusable."""


class NonFiniteGuard(tf.keras.callbacks.Callback):
    """Stops ``fit`` with :class:`NonFiniteTrainingError` once the loss or any weight is NaN or infinite.

    Keras' ``TerminateOnNaN`` only stops training, so a diverged model would
    still be evaluated, saved and exported; this raises instead. The loss is
    checked after every batch, the weights after every epoch.
    """

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(loss):
            raise NonFiniteTrainingError(
                f"the training loss became {loss} at batch {batch + 1}: training diverged; lower the learning "
                "rate (training.learning_rate / head_learning_rate) or check the data")

    def on_epoch_end(self, epoch, logs=None):
        model = getattr(self.model, "model", self.model)
        bad = [v.name for v in model.weights if not np.all(np.isfinite(v.numpy()))]
        if bad:
            raise NonFiniteTrainingError(
                f"after epoch {epoch + 1} the weights {bad[:3]} are not finite: training diverged; lower the "
                "learning rate or check the data")
