"""Keras callbacks that run a fine-tuning method inside ``DPModel.fit``.

:class:`MethodCallback` drives any :class:`sparta_tf.methods.Method` through
its phases (:mod:`sparta_tf.methods.base`): at the first epoch of a phase it
calls ``method.enter`` (set the trainable set, or begin scoring), after the
last epoch ``method.leave`` (e.g. SPARTA's top-k and mask save), and it
labels the ledger's steps with the phase name. :class:`SpartaCallback` is
``MethodCallback("sparta", ...)``. ``make_private``'s model runs its method
itself; these callbacks are for a :class:`~sparta_tf.DPModel` you build and
plan yourself (docs/write-a-method.md, "Driving a method yourself").

Learning-rate schedules: a selection epoch updates no weight, so it does not
advance ``optimizer.iterations``; a schedule of a run with a selection epoch
must span the *update* steps, ``(T - 1) * steps_per_epoch``
(``PrivacyPlan.update_steps``), to reach its end at the last update.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from sparta_tf.method_spec import Phase
from sparta_tf.methods import Method, make_method
from sparta_tf.training_errors import NonFiniteTrainingError


class MethodCallback(tf.keras.callbacks.Callback):
    """Runs fine-tuning ``method`` in ``DPModel.fit``.

    Args:
      method: a :class:`~sparta_tf.methods.Method`, or a name from
        :data:`sparta_tf.methods.METHODS` built with ``options``.
      **options: the method's options (its spec's, with their defaults:
        ``sparta_tf.methods.METHODS[name].spec``), and for every method
        ``head``, ``head_learning_rate_scale``, ``mask_dir`` (where masks are
        saved), ``verbose``.
    """

    def __init__(self, method: str | Method, **options: Any):
        super().__init__()
        if isinstance(method, Method):
            if options:
                raise ValueError("pass options to the Method itself, not to MethodCallback")
            self.method = method
        else:
            self.method = make_method(method, **options)
        self.phase: Phase | None = None
        self._phases: list[Phase] = []  # the phases of the coming fit, from begin()
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

        Raises ValueError (one line) when the phases do not fit ``epochs``, or
        (``method.start``) when ``dp`` is not the DP model the method runs on
        or the method's preparation did not run for it: DP-SSGD needs
        ``method.make_dp_model``, DP-FROST and pruning DP-SSGD need
        ``method.prepare(dp, x, y, loss, plan)`` before ``fit``.
        """
        self.set_model(dp)
        self._phases = self.method.phases(epochs)  # refuses a schedule that does not fit
        self.method.start(dp, epochs, first_epoch)  # refuses a DP model the method was not built or prepared for
        self.phase = None
        self._begun = True

    def on_epoch_begin(self, epoch, logs=None):
        phase = self._phase_at(epoch)
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
        epochs = sum(p.epochs for p in self._phases)
        last_of_phase = epoch + 1 >= epochs or self._phase_at(epoch + 1) != self.phase
        if last_of_phase and self.phase is not None:
            self.method.leave(self.phase, self.model)
            self.phase = None  # the next epoch enters the following phase
        if logs is not None:
            logs["trainable_fraction"] = self.model.trainable_set.fraction_of(self.model.model)


    def _phase_at(self, epoch: int) -> Phase:
        """The phase epoch ``epoch`` (0-based) of the fit belongs to."""
        first = 0
        for phase in self._phases:
            if epoch < first + phase.epochs:
                return phase
            first += phase.epochs
        raise ValueError(f"epoch {epoch} is past the {first} epochs of the plan")


class SpartaCallback(MethodCallback):
    """SPARTA (Makni et al., KDD 2025, Algorithm 1) inside ``DPModel.fit``: ``MethodCallback("sparta", **options)``.

    Its options and their defaults are the ``sparta`` spec's
    (``sparta_tf.method_spec.SPECS["sparta"]``): e.g. ``score`` ``"sum_abs"``
    (paper) or ``"abs_sum"`` (authors' code), ``granularity="entry"`` for the
    no-grouping ablation, ``warmup_epochs`` (default ``T / 5``).
    """

    def __init__(self, **options: Any):
        super().__init__("sparta", **options)


class NonFiniteGuard(tf.keras.callbacks.Callback):
    """Stops ``fit`` with :class:`NonFiniteTrainingError` once any weight is NaN or infinite.

    Keras' ``TerminateOnNaN`` only stops training, so a diverged model would
    still be evaluated, saved and exported; this raises instead. The weights are
    checked after every epoch, and after a batch whose logged loss is not finite.
    The decision reads the weights only: they are what the DP steps release. The
    logged loss is a noiseless mean over the batch's examples, those the step
    dropped as non-finite included, so stopping on it would let one example decide
    whether the run releases anything.
    """

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        bad = self._non_finite_weights() if loss is not None and not np.isfinite(loss) else []
        if bad:
            raise NonFiniteTrainingError(
                f"the weights {bad[:3]} became non-finite at batch {batch + 1}: training "
                "diverged; lower the learning rate (training.learning_rate / head_learning_rate) or check the data")

    def _non_finite_weights(self) -> list[str]:
        model = getattr(self.model, "model", self.model)
        return [v.name for v in model.weights if not np.all(np.isfinite(v.numpy()))]

    def on_epoch_end(self, epoch, logs=None):
        bad = self._non_finite_weights()
        if bad:
            raise NonFiniteTrainingError(
                f"after epoch {epoch + 1} the weights {bad[:3]} are not finite: training diverged; lower the "
                "learning rate or check the data")
