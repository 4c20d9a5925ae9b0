"""How every DP step of a :class:`~sparta_tf.DPModel` is charged to its ledger, resumed runs included.

A step is one run of the model's :class:`~sparta_tf.privacy.mechanism.DpSgdMechanism` ``M``
(``dp.mechanism``, the object the step's noise, normalisation and sampler read). The ledger is
charged ``M.entry(k)`` for the ``k`` steps the model's ``dp_step`` counter counted, and nothing
else, wherever they ran:

* in ``fit``: by the model's own :class:`~sparta_tf.privacy.callbacks.PrivacyCallback`, built
  from ``dp.mechanism`` (:func:`model_callback`); a caller's ``PrivacyCallback`` is refused, since
  it would charge another object than the one the steps run;
* before each step with a run directory: ``ledger.json`` is rewritten with that step already
  charged, then the step journal says it started (:class:`StepJournal`), so a kill at any point
  over-counts at most;
* on resume: the steps a killed run started after its last checkpoint (the journal's count,
  the largest over workers in a multi-worker run) are charged as ``M.entry(lost, "interrupted")``
  (:func:`charge_interrupted_steps`); the mechanisms a killed run ran before its first step
  likewise (:func:`charge_interrupted_before_training`). With bands, the steps of each process are
  their own entry (:func:`steps_per_process`): a run killed twice before its first checkpoint ran
  ``l_1`` and ``l_2`` steps in two processes, each with its own secret cyclic groups, so an example
  may take part ``ceil(l_1 / b) + ceil(l_2 / b)`` times, not ``ceil((l_1 + l_2) / b)``.

Files (under ``run_dir/checkpoints/``, beside :mod:`sparta_tf.checkpointing`'s checkpoints):
``journal.json`` (``{"started_through": t, "mechanism": ..., "process_starts": [s, ...]}``: the steps
started, and the step at which each process that journalled them began) and ``before_training.json``
(runs started, and one run's entries), written, like everything in the run directory, by
``checkpointing.write_atomic``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

import tensorflow as tf

from sparta_tf import checkpointing, distribute, keras_trainer
from sparta_tf.checkpointing import BEFORE_TRAINING, CHECKPOINTS, JOURNAL, LEDGER, CheckpointError
from sparta_tf.masks import is_mask_charge
from sparta_tf.privacy.callbacks import PrivacyCallback
from sparta_tf.privacy.layout import SamplingLayout
from sparta_tf.privacy.ledger import INTERRUPTED, LedgerEntry, PrivacyLedger
from sparta_tf.privacy.mechanism import DpSgdMechanism

# ------------------------------------------------------------------ fit


def model_callback(dp, callbacks: list, steps_per_epoch: int, on_budget_exhausted) -> PrivacyCallback | None:
    """The model's own :class:`PrivacyCallback` for this ``fit`` (None without a ledger).

    One callback for the model's life, built from ``dp.mechanism``: it counts ``dp_step`` from its
    last record, so the steps of a ``fit`` that ended in an exception (no ``on_epoch_end`` /
    ``on_train_end``) are charged when the next ``fit`` begins. A caller's ``PrivacyCallback`` is
    refused (one line): the model charges its ledger itself.
    """
    for callback in callbacks:
        if isinstance(callback, PrivacyCallback):
            refuse_caller_callback(dp, callback)
    if dp.ledger is None:
        return None
    own = dp.privacy_callback
    mine = (dp.noise_multiplier, dp.sample_rate)
    if own is not None and own.ledger is dp.ledger and (own.noise_multiplier, own.sample_rate) != mine:
        raise ValueError(f"the model's PrivacyCallback was set to charge noise_multiplier {own.noise_multiplier:g}, "
                         f"sample_rate {own.sample_rate:g}, but the steps run the model's mechanism "
                         f"(noise_multiplier {dp.noise_multiplier:g}, sample_rate {dp.sample_rate:g}); leave it as "
                         "the model built it")
    budget_mode = "strict" if dp.private_run is None else dp.private_run.budget_mode
    if (own is None or own.ledger is not dp.ledger or own.step_counter is not dp.dp_step
            or own.mechanism is not dp.mechanism):
        if own is not None and own.ledger is dp.ledger and own.step_counter is dp.dp_step:
            own.flush()  # the steps counted so far, under the mechanism they ran
        own = PrivacyCallback(dp.ledger, dp.mechanism, steps_per_epoch, step_counter=dp.dp_step,
                              on_budget_exhausted=on_budget_exhausted, budget_mode=budget_mode)
    else:
        own.flush()  # an interrupted fit's steps
        own.steps_per_epoch = steps_per_epoch
        own.on_budget_exhausted = on_budget_exhausted
        own.budget_mode = budget_mode
    own.layout = dp.sampling_layout
    check_ledger_covers_dp_step(dp, own)
    return own


def refuse_caller_callback(dp, callback: PrivacyCallback) -> None:
    """A ``PrivacyCallback`` passed to a DP model's ``fit`` is refused: it charges its own mechanism,
    not the one the model's steps run."""
    mine = dp.mechanism
    raise ValueError(
        f"fit got a PrivacyCallback (noise_multiplier {callback.noise_multiplier:g}, sample_rate "
        f"{callback.sample_rate:g}); leave it out: a DPModel charges its ledger itself, from the mechanism its "
        f"steps run (noise_multiplier {mine.noise_multiplier:g}, sample_rate {mine.sample_rate:g}"
        f"{'' if dp.ledger is not None else '; give the DPModel a delta to have a ledger'})")


def check_ledger_covers_dp_step(dp, callback: PrivacyCallback) -> None:
    """``dp_step`` counts every DP step this model's weights have been through; the ledger must
    hold at least as many (recorded or pending), or epsilon would leave steps out: e.g. after
    ``checkpoint_state()`` was restored into a new DPModel whose ledger starts empty."""
    recorded = sum(entry.count for entry in dp.ledger.entries
                   if entry.kind == callback.kind and not is_mask_charge(entry))
    ran = int(dp.dp_step.numpy())
    if recorded + callback.pending_steps() < ran:
        raise ValueError(
            f"dp_step is {ran} but the privacy ledger records {recorded} DP steps: restore the ledger "
            "saved with the checkpoint (dp_model.ledger = PrivacyLedger.from_json(...)) before fit, "
            "or epsilon would leave the other steps out"
        )


# ------------------------------------------------------------------ the step journal


class StepJournal(tf.keras.callbacks.Callback):
    """Before each training step: ``ledger.json`` charges it, then the journal says it started. With
    ``steps_per_execution = N`` Keras calls it once before a call of ``N`` steps, so it charges and
    journals all ``N`` (the last call of an epoch may run fewer: an over-count, which is safe). The
    journal keeps the step at which each process began (the earlier ones' before this one's first step)."""

    def __init__(self, output_dir: str):
        super().__init__()
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, CHECKPOINTS, JOURNAL)
        self.ledger_path = os.path.join(output_dir, LEDGER)
        self.process_starts: list[int] | None = None  # read at this process's first step
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def on_train_batch_begin(self, batch, logs=None):
        dp = self.model
        privacy = dp.privacy_callback
        steps = keras_trainer.steps_per_execution(dp)
        if privacy is not None:  # first the ledger, then the journal: a kill in between over-counts only
            charged = PrivacyLedger.from_json(privacy.ledger.to_json())
            for entry in privacy.charges(extra_steps=steps):
                charged.charge(entry)
            checkpointing.write_atomic(self.ledger_path, json.dumps(charged.to_json(), indent=1))
        step = int(dp.dp_step.numpy())
        if self.process_starts is None:
            self.process_starts = [s for s in _read_journal(self.output_dir)[1] if s < step] + [step]
        checkpointing.write_atomic(self.path, json.dumps({"started_through": step + steps,
                                                          "mechanism": mechanism_record(dp.mechanism),
                                                          "process_starts": self.process_starts}))


def mechanism_record(mechanism: DpSgdMechanism) -> dict:
    """What the journal keeps of the steps' mechanism: ``sigma``, ``q`` and the bands."""
    return {"noise_multiplier": mechanism.noise_multiplier, "sample_rate": mechanism.sample_rate,
            "bands": mechanism.bands}


def check_journalled_mechanism(output_dir: str, mechanism: DpSgdMechanism) -> None:
    """CheckpointError unless the steps the journal counts ran ``mechanism`` (a journal written before it
    recorded one is not checked): lost steps are charged as the resuming run's mechanism, which must be
    theirs (a resume with another budget would charge them at another noise, an under-count)."""
    path = os.path.join(output_dir, CHECKPOINTS, JOURNAL)
    if not os.path.exists(path):
        return
    with open(path) as f:
        recorded = json.load(f).get("mechanism")
    mine = mechanism_record(mechanism)
    if recorded is not None and (recorded.get("bands") != mine["bands"] or any(
            not math.isclose(float(recorded[key]), mine[key], rel_tol=1e-9) for key in ("noise_multiplier",
                                                                                        "sample_rate"))):
        raise CheckpointError(
            f"the interrupted run in {output_dir} ran its steps with noise multiplier "
            f"{float(recorded['noise_multiplier']):.6g} at sample rate {float(recorded['sample_rate']):.6g} "
            f"(bands {recorded.get('bands')}), this run's plan with {mine['noise_multiplier']:.6g} at "
            f"{mine['sample_rate']:.6g} (bands {mine['bands']}): resume with the privacy settings it was started "
            "with (target epsilon, delta, batch size, epochs), or start a new output_dir")


def _read_journal(output_dir: str) -> tuple[int, list[int]]:
    """The journal's steps started and the steps at which the processes that journalled them began
    (``(0, [])`` without a journal; no starts in a journal written before they were recorded)."""
    path = os.path.join(output_dir, CHECKPOINTS, JOURNAL)
    if not os.path.exists(path):
        return 0, []
    try:
        with open(path) as f:
            journal = json.load(f)
        return int(journal["started_through"]), [int(s) for s in journal.get("process_starts", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"the step journal {path} is damaged ({error}): the steps the killed run started "
                              "cannot be counted, so it cannot be resumed safely; start a new output_dir") from None


def steps_started_after(output_dir: str, checkpoint_step: int) -> int:
    """How many steps this process's journal says a killed run started after ``checkpoint_step``."""
    return max(0, _read_journal(output_dir)[0] - checkpoint_step)


def steps_per_process(output_dir: str, checkpoint_step: int, lost: int, strategy: tf.distribute.Strategy) -> list[int]:
    """The ``lost`` steps after ``checkpoint_step`` split by the process that started them (the journal's
    process starts in between; one part from a journal that records none). On several workers the starts
    are agreed, index by index, as the largest (a worker killed before its newest process journalled
    lacks only that start), so every ledger gets the same parts."""
    own = [s for s in _read_journal(output_dir)[1] if checkpoint_step < s < checkpoint_step + lost]
    parts = distribute.largest_over_workers(strategy, len(own))
    starts = [distribute.largest_over_workers(strategy, own[i] if i < len(own) else 0) for i in range(parts)]
    bounds = [checkpoint_step, *sorted(set(starts)), checkpoint_step + lost]
    return [stop - start for start, stop in zip(bounds, bounds[1:]) if stop > start]


def charge_interrupted_steps(output_dir: str, checkpoint_step: int, ledger: PrivacyLedger,
                             mechanism: DpSgdMechanism, strategy: tf.distribute.Strategy,
                             layout: SamplingLayout | None = None) -> int:
    """Charges ``mechanism.entry(lost, "interrupted")`` for the ``lost`` steps a killed run started
    after the last checkpoint; returns ``lost``. With bands, one entry per process that started them
    (:func:`steps_per_process`; the ledger keeps banded interrupted entries apart). With a ``layout`` that
    samples some steps plainly the lost steps are charged both ways
    (:meth:`~sparta_tf.privacy.layout.SamplingLayout.charges` without a first step): which kind each was is
    not recorded, and an over-count is safe.

    On several workers each keeps its own journal, and a kill leaves them a step or two apart;
    every worker charges the *largest* count (``max_w lost_w``), so the ledgers, and with them the
    step at which the privacy budget stops training, are the same on every worker and never
    under-count the steps any worker started.
    """
    lost = distribute.largest_over_workers(strategy, steps_started_after(output_dir, checkpoint_step))
    if lost:
        check_journalled_mechanism(output_dir, mechanism)
    layout = layout if layout is not None else SamplingLayout()
    parts = steps_per_process(output_dir, checkpoint_step, lost, strategy) if lost and mechanism.bands > 1 else [lost]
    for part in parts if lost else ():
        for entry in layout.charges(mechanism, None, part, phase=INTERRUPTED):
            ledger.charge(entry)
    return lost


def update_checkpoint_ledger(path: str, ledger: PrivacyLedger) -> None:
    """Rewrites checkpoint ``path``'s ledger (after charging interrupted steps), so that a second kill
    before the next checkpoint cannot lose the charge."""
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    text = json.dumps(dict(state, ledger=ledger.to_json()), indent=1)
    checkpointing.write_atomic(os.path.join(path, "state.json"), text)


# ------------------------------------------------------------------ before the first step


def journal_before_training(output_dir: str, ledger: PrivacyLedger, entries: Sequence[LedgerEntry],
                            inputs: dict | None = None) -> None:
    """Before mechanisms that draw noise ahead of the first DP step (``entries``: one run's charge):
    writes ``ledger.json`` with them already charged, then counts one more started run, so that no
    kill, during or after them, once or repeatedly, can drop a run from the ledger; ``inputs``: what they
    ran on (:func:`~sparta_tf.resume_inputs.resume_inputs`), which a restart must share
    (:func:`inputs_before_training`)."""
    if not entries:
        return
    charged = PrivacyLedger.from_json(ledger.to_json())
    for entry in entries:
        charged.charge(entry)
    checkpointing.write_atomic(os.path.join(output_dir, LEDGER), json.dumps(charged.to_json(), indent=1))
    path = os.path.join(output_dir, CHECKPOINTS, BEFORE_TRAINING)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    started = _runs_started_before_training(output_dir) + 1
    record = {"runs_started": started, "entries": [e.to_dict() for e in entries]}
    if inputs is not None:
        record["inputs"] = inputs
    checkpointing.write_atomic(path, json.dumps(record, indent=1))


def inputs_before_training(output_dir: str) -> tuple[str, dict | None]:
    """``(the record's description, the inputs it holds)`` of the mechanisms a killed run ran before training
    (None without a record, or one that holds none)."""
    path = os.path.join(output_dir, CHECKPOINTS, BEFORE_TRAINING)
    record = _read_before_training(path)
    return f"{path} (the mechanisms a killed run ran before training)", None if record is None else record.get("inputs")


def _runs_started_before_training(output_dir: str) -> int:
    return _before_training_record(output_dir)[0]


def _before_training_record(output_dir: str) -> tuple[int, list[LedgerEntry]]:
    """``before_training.json`` read: the runs that started the mechanisms before training, and the entries
    they charged (one run's, as they recorded them); ``(0, [])`` when there is none; CheckpointError when it
    is damaged."""
    path = os.path.join(output_dir, CHECKPOINTS, BEFORE_TRAINING)
    record = _read_before_training(path)
    if record is None:
        return 0, []
    try:
        return int(record["runs_started"]), [LedgerEntry.from_dict(e) for e in record.get("entries", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise _damaged(path, error) from None


def _read_before_training(path: str) -> dict | None:
    """``before_training.json`` as a dict (None when there is none); CheckpointError when it is damaged."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as error:
        raise _damaged(path, error) from None
    if not isinstance(record, dict):
        raise _damaged(path, f"not an object: {type(record).__name__}")
    return record


def _damaged(path: str, error) -> CheckpointError:
    return CheckpointError(f"{path} is damaged ({error}): the mechanisms the killed runs started cannot be "
                           "counted, so it cannot be resumed safely; start a new output_dir")


def charge_interrupted_before_training(output_dir: str, ledger: PrivacyLedger, planned: Sequence[LedgerEntry],
                                       strategy: tf.distribute.Strategy) -> int:
    """In a run resumed before its first checkpoint: records ``planned`` (one run of the mechanisms
    that draw noise before training; the same config) once for every run the killed runs started
    (the largest count over workers), under the phase ``interrupted``; returns that count. Their
    releases (a mask on disk, the steps that used it) may have been observed, and the resumed run
    runs them again (under a new secret seed unless the config fixes one: then the same draw,
    charged twice, an over-count)."""
    if not planned:
        return 0
    runs_here, ran = _before_training_record(output_dir)
    started = distribute.largest_over_workers(strategy, runs_here)
    for _ in range(started):
        for entry in ran or planned:  # what the killed runs ran (recorded), not this run's plan
            ledger.charge(dataclasses.replace(entry, phase=INTERRUPTED))
    return started


def charge_steps_before_first_checkpoint(dp, before_training: Sequence[LedgerEntry], run_dir: str) -> None:
    """A run killed before its first checkpoint starts over; the steps (of ``dp.mechanism``) and the
    mechanisms before training (``before_training``: one run's releases) it ran stay charged."""
    runs = charge_interrupted_before_training(run_dir, dp.ledger, before_training, dp.distribute_strategy)
    if runs:
        print(f"== the mechanisms before training, run {runs} time(s) by the interrupted run(s), charged to the ledger")
    lost = charge_interrupted_steps(run_dir, 0, dp.ledger, dp.mechanism, dp.distribute_strategy, dp.sampling_layout)
    if lost:
        dp.dp_step.assign(lost)  # fresh noise and batch keys; the journal keeps counting every step run
        print(f"== {lost} step(s) of the interrupted run (before its first checkpoint) charged to the ledger")
