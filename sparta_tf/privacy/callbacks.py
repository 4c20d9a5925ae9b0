"""Keras callback that records DP mechanism runs in a ledger and enforces the budget.

Every noisy update the model performs is one run of the Poisson-subsampled
Gaussian mechanism ``M_{q, sigma}`` described by a
:class:`~sparta_tf.privacy.mechanism.DpSgdMechanism`. :class:`PrivacyCallback`
counts those runs, charges ``mechanism.entry(runs)`` to a
:class:`~sparta_tf.privacy.ledger.PrivacyLedger` (so the charge is derived from
the mechanism object the steps ran with, never from a copy of its values), logs
``epsilon`` at each epoch end, and makes sure no update runs that would take the
ledger past ``ledger.target_epsilon``. A :class:`~sparta_tf.DPModel` builds its
own callback from its mechanism (:mod:`sparta_tf.privacy.charging`); this class
is public for plain Keras models.

Facts of ``Model.fit`` the design relies on (Keras 2.15 and Keras 3 alike; the tests run on both):

* ``params`` is ``{"verbose", "epochs", "steps"}``; the initial epoch is not in
  it, so the whole-run budget check happens at the first ``on_epoch_begin``
  (whose ``epoch`` is the initial epoch), still before any step runs.
* ``model.stop_training`` is read only *after* a batch and after
  ``on_epoch_end``. Setting it in ``on_epoch_begin`` would still let one batch
  run, so the graceful stop is decided at the previous ``on_epoch_end``
  (look-ahead); when a stop is needed where ``stop_training`` cannot prevent
  the next step (``on_epoch_begin`` / ``on_train_batch_begin``, e.g. because
  other code lowered ``sigma``), the callback records, calls the save hook and
  raises :class:`PrivacyBudgetExceededError` instead.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf

from sparta_tf import keras_trainer
from sparta_tf.privacy import accounting
from sparta_tf.privacy.accounting import PrivacyBudgetExceededError
from sparta_tf.privacy.layout import SamplingLayout
from sparta_tf.privacy.ledger import DEFAULT_KIND, LedgerEntry, PrivacyLedger
from sparta_tf.privacy.mechanism import DpSgdMechanism

__all__ = ["PrivacyCallback", "BUDGET_MODES"]

BUDGET_MODES: tuple[str, ...] = ("strict", "until_exhausted")
"""``"strict"``: refuse to start a fit whose planned epochs would exceed the
target. ``"until_exhausted"``: train while the budget lasts; an epoch that no
longer fits whole runs the steps that still fit, then training stops
gracefully (e.g. a resumed run whose interrupted steps were charged)."""


class PrivacyCallback(tf.keras.callbacks.Callback):
    """Records mechanism runs in ``ledger``, logs ``epsilon``, enforces the budget.

    Args:
      ledger: the :class:`PrivacyLedger` to record into; its
        ``target_epsilon`` is the budget (``None``: record and log only).
      mechanism: the :class:`DpSgdMechanism` (``sigma``, ``q``) of the updates the model performs now.
      steps_per_epoch: noisy updates per epoch, used to plan the budget;
        ``None`` uses Keras's ``params["steps"]`` (one update per batch).
      phase: label recorded with the runs (e.g. ``"warmup"``); ``None``: none.
      kind: mechanism label recorded with the runs (default ``"dp_sgd_step"``).
      step_counter: an integer ``tf.Variable`` the model increments once per
        noisy update actually performed. ``None``: count training batches
        (``on_train_batch_end`` calls, times ``steps_per_execution``).
      on_budget_exhausted: zero-argument callable (a save hook), called after
        the pending runs are recorded and before training stops for budget.
      budget_mode: one of :data:`BUDGET_MODES` (default ``"strict"``).
      verbose: print one line when training stops for budget.

    ``mechanism``, ``phase`` and ``kind`` are settable attributes (``noise_multiplier``
    and ``sample_rate`` replace the mechanism by one with that value). Setting one to a
    new value first records the runs performed so far under the old one, so every run
    is recorded with the mechanism in force.
    The budget check assumes that the remaining epochs of the current ``fit``
    use the current values.
    """

    def __init__(
        self,
        ledger: PrivacyLedger,
        mechanism: DpSgdMechanism,
        steps_per_epoch: int | None = None,
        phase: str | None = None,
        step_counter: tf.Variable | None = None,
        on_budget_exhausted: Callable[[], object] | None = None,
        kind: str = DEFAULT_KIND,
        budget_mode: str = "strict",
        verbose: int = 1,
    ) -> None:
        super().__init__()
        if budget_mode not in BUDGET_MODES:
            raise ValueError(f"budget_mode must be one of {BUDGET_MODES}, got {budget_mode!r}.")
        self.ledger = ledger
        if not isinstance(mechanism, DpSgdMechanism):
            raise ValueError(f"mechanism must be a DpSgdMechanism(noise_multiplier, sample_rate), got {mechanism!r}")
        self._mechanism = mechanism
        self._phase = phase
        self._kind = kind
        self.steps_per_epoch = steps_per_epoch
        self.step_counter = step_counter
        self.on_budget_exhausted = on_budget_exhausted
        self.budget_mode = budget_mode
        self.verbose = verbose
        self.budget_exhausted = False
        """True once training was stopped because the budget ran out."""
        self.layout: SamplingLayout | None = None
        """How each counted run sampled (:mod:`sparta_tf.privacy.layout`), read by global step (needs
        ``step_counter``); None: every run is ``mechanism.entry``."""
        self._reset_progress()

    # ------------------------------------------------------------ mechanism values

    @property
    def steps_per_epoch(self) -> int | None:
        return self._steps_per_epoch

    @steps_per_epoch.setter
    def steps_per_epoch(self, value: int | None) -> None:
        self._steps_per_epoch = None if value is None else accounting.check_steps(value, "steps_per_epoch")

    @property
    def mechanism(self) -> DpSgdMechanism:
        """The mechanism every counted run is charged as."""
        return self._mechanism

    @mechanism.setter
    def mechanism(self, value: DpSgdMechanism) -> None:
        self._switch(value != self._mechanism, "_mechanism", value)

    @property
    def noise_multiplier(self) -> float:
        return self._mechanism.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self.mechanism = dataclasses.replace(self._mechanism, noise_multiplier=value)

    @property
    def sample_rate(self) -> float:
        return self._mechanism.sample_rate

    @sample_rate.setter
    def sample_rate(self, value: float) -> None:
        self.mechanism = dataclasses.replace(self._mechanism, sample_rate=value)

    @property
    def phase(self) -> str | None:
        return self._phase

    @phase.setter
    def phase(self, value: str | None) -> None:
        self._switch(value != self._phase, "_phase", value)

    @property
    def kind(self) -> str:
        return self._kind

    @kind.setter
    def kind(self, value: str) -> None:
        self._switch(value != self._kind, "_kind", value)

    def _switch(self, changed: bool, attribute: str, value: object) -> None:
        """Records pending runs under the old values, then sets the new one."""
        if changed:
            self.flush()
            self._allowance = None  # re-approve the rest of the epoch at the next batch
        setattr(self, attribute, value)

    # ------------------------------------------------------------ counting

    def _reset_progress(self) -> None:
        self._counter_mark = self._read_counter()  # counter value at the last flush
        self._batches = 0  # fallback: batches run since the last flush
        self._batch_begin = 0
        self._recorded = 0  # runs recorded by this callback since on_train_begin
        self._epoch_start = 0  # self._progress() at on_epoch_begin
        self._allowance: int | None = None  # runs approved for the current epoch
        self._partial = False  # the approved runs are fewer than the epoch's: stop after them
        self._plan_checked = False

    def _read_counter(self) -> int:
        return 0 if self.step_counter is None else int(tf.keras.backend.get_value(self.step_counter))

    def pending_steps(self) -> int:
        """Runs performed but not yet recorded in the ledger."""
        if self.step_counter is None:
            return self._batches
        pending = self._read_counter() - self._counter_mark
        if pending < 0:
            raise RuntimeError("step_counter decreased during training; it must only count up.")
        return pending

    def charges(self, extra_steps: int = 0) -> list[LedgerEntry]:
        """The ledger entries of the pending runs plus ``extra_steps`` more, under the current mechanism
        and, with a :attr:`layout`, as it samples each of them (by the step counter: the first pending run
        is global step ``counter at the last flush``)."""
        steps = self.pending_steps() + extra_steps
        if self.layout is None:
            return [self._mechanism.entry(steps, self._phase, self._kind)]
        return self.layout.charges(self._mechanism, self._counter_mark, steps, self._phase, self._kind)

    def flush(self) -> int:
        """Records the pending runs under the current mechanism; returns how many."""
        pending = self.pending_steps()
        for entry in self.charges():
            self.ledger.charge(entry)
        self._counter_mark += pending if self.step_counter is not None else 0
        self._batches = 0
        self._recorded += pending
        return pending

    def _steps_per_call(self) -> int:
        """Updates one train-function call may run (Keras ``steps_per_execution``)."""
        return keras_trainer.steps_per_execution(self.model)

    def _progress(self) -> int:
        return self._recorded + self.pending_steps()

    # ------------------------------------------------------------ budget

    def _planned_steps_per_epoch(self) -> int | None:
        if self.steps_per_epoch is not None:
            return self.steps_per_epoch
        return self.params.get("steps") if self.params else None

    def _planned(self, extra_steps: int) -> list[LedgerEntry]:
        """Pending runs plus ``extra_steps`` future ones, all under the current mechanism."""
        return self.charges(extra_steps)

    def _fits(self, extra_steps: int) -> bool:
        return self.ledger.fits_budget(self._planned(extra_steps))

    def _over_budget_message(self, what: str, extra_steps: int) -> str:
        planned = self.ledger.epsilon_if(self._planned(extra_steps))
        return (
            f"{what} needs epsilon={planned:.4g} > target_epsilon={self.ledger.target_epsilon:g} "
            f"(delta={self.ledger.delta:g}, {self.ledger.accountant}, "
            f"noise_multiplier={self.noise_multiplier:g}, sample_rate={self.sample_rate:g}, "
            f"already spent {self.ledger.epsilon():.4g}); "
            "raise noise_multiplier, train fewer epochs, or lower the sample rate."
        )

    def _check_plan(self, epoch: int, steps_per_epoch: int) -> int:
        """Before the first step of this fit: refuse a plan that exceeds the target; returns the
        steps of this epoch that may run."""
        epochs = 1
        if self.budget_mode == "strict":
            epochs = max(self.params.get("epochs", epoch + 1) - epoch, 1)
        if self._fits(epochs * steps_per_epoch):
            return steps_per_epoch
        partial = self._steps_that_fit(steps_per_epoch) if self.budget_mode == "until_exhausted" else 0
        if partial:
            return partial
        what = f"the planned run ({epochs} epoch(s) x {steps_per_epoch} steps)"
        raise PrivacyBudgetExceededError(self._over_budget_message(what, epochs * steps_per_epoch))

    def _steps_that_fit(self, steps: int) -> int:
        """The largest ``k <= steps`` such that ``k`` more steps stay within the budget (bisection)."""
        low, high = 0, steps  # fits(low) holds (nothing new), fits(high) may not
        if self._fits(high):
            return high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self._fits(middle) else (low, middle)
        return low

    def _exhaust(self, message: str) -> None:
        """Records pending runs, calls the save hook and prints why training stops."""
        self.flush()
        self.budget_exhausted = True
        if self.on_budget_exhausted is not None:
            self.on_budget_exhausted()
        if self.verbose:
            print(f"PrivacyCallback: {message}", flush=True)

    def _exhaust_and_raise(self, what: str, extra_steps: int) -> None:
        message = self._over_budget_message(what, extra_steps)
        self._exhaust(f"stopping before the privacy budget is exceeded: {message}")
        raise PrivacyBudgetExceededError(message)

    # ------------------------------------------------------------ Keras hooks

    def on_train_begin(self, logs=None) -> None:
        if self._read_counter() >= self._counter_mark:
            self.flush()  # runs made outside fit() since the last record
        self._reset_progress()  # a counter reset to 0 by fit() is fine too
        self.budget_exhausted = False
        if self.ledger.target_epsilon is not None and self._planned_steps_per_epoch() is None:
            raise ValueError(
                "steps_per_epoch is unknown (the dataset has no known length); "
                "pass steps_per_epoch= to PrivacyCallback so the privacy budget can be planned."
            )

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._epoch_start = self._progress()
        self._allowance = None
        if self.ledger.target_epsilon is None:
            return
        steps = self._planned_steps_per_epoch()
        if not self._plan_checked:
            self._plan_checked = True
            allowed = self._check_plan(epoch, steps)
        else:
            allowed = steps if self._fits(steps) else self._partial_steps(steps)
            if not allowed:
                self._exhaust_and_raise(f"epoch {epoch + 1} ({steps} steps)", steps)
        self._allowance = allowed
        self._partial = allowed < steps
        if self._partial and self.verbose:
            print(f"PrivacyCallback: only {allowed} of the {steps} steps of epoch {epoch + 1} fit the privacy "
                  "budget; the epoch runs them and training stops", flush=True)

    def _partial_steps(self, steps: int) -> int:
        return self._steps_that_fit(steps) if self.budget_mode == "until_exhausted" else 0

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._batch_begin = batch
        if self.ledger.target_epsilon is None:
            return
        done = self._progress() - self._epoch_start
        upcoming = self._steps_per_call()
        if self._allowance is not None and done + upcoming <= self._allowance:
            return
        remaining = max(self._planned_steps_per_epoch() - done, upcoming)
        if self._fits(remaining):
            self._allowance = done + remaining
            return
        fitting = self._partial_steps(remaining) if self.budget_mode == "until_exhausted" else (
            upcoming if self._fits(upcoming) else 0)
        if fitting >= upcoming:  # the rest of the epoch does not fit: run what does, then stop
            self._allowance, self._partial = done + fitting, self.budget_mode == "until_exhausted"
            return
        what = "one more step" if upcoming == 1 else f"{upcoming} more steps (steps_per_execution)"
        self._exhaust_and_raise(what, upcoming)

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self.step_counter is None:
            self._batches += batch - self._batch_begin + 1
        if self._partial and self._progress() - self._epoch_start >= self._allowance:
            self.model.stop_training = True
            self._exhaust(f"privacy budget reached after {self._allowance} steps of the epoch: stopping "
                          f"(epsilon={self.ledger.epsilon_if(self._planned(0)):.4g}).")

    def on_epoch_end(self, epoch, logs=None) -> None:
        self.flush()
        epsilon = self.ledger.epsilon()
        if logs is not None:
            logs["epsilon"] = epsilon
        if self.ledger.target_epsilon is None or self.model.stop_training:
            return
        if epoch + 1 >= self.params.get("epochs", 0):
            return
        steps = self._planned_steps_per_epoch()
        if not self._fits(steps) and not self._partial_steps(steps):
            planned = self.ledger.epsilon_if(self._planned(steps))
            self.model.stop_training = True
            self._exhaust(
                f"privacy budget exhausted, stopping after epoch {epoch + 1}: epsilon={epsilon:.4g}, "
                f"one more epoch ({steps} steps) would reach {planned:.4g} > "
                f"target_epsilon={self.ledger.target_epsilon:g}."
            )

    def on_train_end(self, logs=None) -> None:
        self.flush()
