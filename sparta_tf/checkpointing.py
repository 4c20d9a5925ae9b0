"""Per-epoch checkpoints that a killed run resumes from, and the step journal.

``output_dir/checkpoints/epoch-NNNN/`` holds a ``tf.train.Checkpoint`` of the
model weights, the masked optimizer's state, the Keras optimizer's step
counter and the DP step counter, plus ``state.json`` (epoch, seed, ledger).
A checkpoint is written into a temporary directory and renamed, and
``checkpoints/latest`` (the name of the newest complete checkpoint) is
replaced atomically afterwards: a crash at any point leaves the previous
checkpoint as the latest. The last :data:`KEEP` checkpoints are kept; a
damaged newest one (truncated, foreign, unreadable) is skipped for the one
before it, with a note.

The step journal (``checkpoints/journal.json``) records, before every step,
the DP step about to run, and ``ledger.json`` is rewritten with that step
already charged: the ledger on disk never under-counts steps that ran. After
a SIGKILL the steps between the last checkpoint and the journal were run
(their noisy updates may have been observed), so
:func:`charge_interrupted_steps` records them in the ledger before training
resumes: epsilon is never under-counted.

Mechanisms that run before the first DP step (DP-FROST's selection rounds,
DP-SNIP) are journalled the same way: ``checkpoints/before_training.json``
is written before they run, and a run resumed before its first checkpoint
charges them (:func:`charge_interrupted_before_training`) before running
them again; after a checkpoint the checkpoint's ledger holds them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Sequence

import tensorflow as tf

from sparta_tf import distribute
from sparta_tf.atomic_files import write_atomic
from sparta_tf.privacy import LedgerEntry, PrivacyLedger

CHECKPOINTS = "checkpoints"
LATEST = "latest"
JOURNAL = "journal.json"
BEFORE_TRAINING = "before_training.json"
LEDGER = "ledger.json"
KEEP = 2


class CheckpointError(ValueError):
    """No usable checkpoint (damaged, foreign or missing files); the message names the fix."""


def save(output_dir: str, epoch: int, dp_model, state: dict) -> str:
    """Writes the checkpoint after ``epoch`` (1-based count of finished epochs)."""
    root = os.path.join(output_dir, CHECKPOINTS)
    os.makedirs(root, exist_ok=True)
    name = f"epoch-{epoch:04d}"
    tmp = tempfile.mkdtemp(dir=root, prefix=".partial-")
    try:
        tf.train.Checkpoint(**dp_model.checkpoint_state()).write(os.path.join(tmp, "ckpt"))
        with open(os.path.join(tmp, "state.json"), "w") as f:
            json.dump(dict(state, epoch=epoch), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = os.path.join(root, name)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(os.path.join(root, LATEST), name)
    _prune(root, keep=name)
    return final


def _prune(root: str, keep: str) -> None:
    complete = sorted(d for d in os.listdir(root) if d.startswith("epoch-"))
    for old in complete[:-KEEP]:
        if old != keep:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    for partial in os.listdir(root):
        if partial.startswith(".partial-"):
            shutil.rmtree(os.path.join(root, partial), ignore_errors=True)


def has_state(output_dir: str) -> str | None:
    """What a killed run left in ``output_dir`` (a description), or None when there is nothing."""
    root = os.path.join(output_dir, CHECKPOINTS)
    complete = sorted(d for d in os.listdir(root) if d.startswith("epoch-")) if os.path.isdir(root) else []
    if complete:
        return f"checkpoint {complete[-1]}"
    if os.path.exists(os.path.join(root, JOURNAL)):
        return "a step journal, no checkpoint yet"
    if os.path.exists(os.path.join(root, BEFORE_TRAINING)):
        return "mechanisms run before training, no step yet"
    return None


def candidates(output_dir: str) -> list[str]:
    """Complete checkpoint directories, newest first."""
    root = os.path.join(output_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root), reverse=True) if d.startswith("epoch-")]


def read_state(path: str) -> dict:
    """``state.json`` of checkpoint ``path``, checked; CheckpointError if it is damaged."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        PrivacyLedger.from_json(state["ledger"])
        int(state["epoch"]), int(state["seed"])
        tf.train.load_checkpoint(os.path.join(path, "ckpt"))  # the index and the shards are there
    except (OSError, ValueError, KeyError, TypeError, tf.errors.OpError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise CheckpointError(f"checkpoint {path} is damaged ({first})") from None
    return state


def latest(output_dir: str) -> tuple[str, dict] | None:
    """``(checkpoint dir, state)`` of the newest readable checkpoint, or None when there is none.

    A damaged newer checkpoint is skipped (with a note) for an older one; the
    steps after the older one are charged from the journal like any other
    interrupted steps. CheckpointError when checkpoints exist but none is readable.
    """
    problems = []
    for path in candidates(output_dir):
        try:
            state = read_state(path)
        except CheckpointError as error:
            problems.append(str(error))
            print(f"== note: {error}; trying an older checkpoint")
            continue
        return path, state
    if problems:
        raise CheckpointError(f"no usable checkpoint in {output_dir}: {problems[-1]}; start a new output_dir "
                              "(the interrupted run cannot be continued)")
    return None


def update_ledger(path: str, ledger) -> None:
    """Rewrites checkpoint ``path``'s ledger (after charging interrupted steps), so that a second kill
    before the next checkpoint cannot lose the charge."""
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    write_atomic(os.path.join(path, "state.json"), json.dumps(dict(state, ledger=ledger.to_json()), indent=1))


def restore(path: str, dp_model) -> None:
    """Restores a checkpoint into a DPModel set up for the phase of the next epoch.

    Weights and counters must all match. Optimizer state is restored for the
    selections the checkpoint has; a selection that starts with this epoch
    (SPARTA's rows after the selection epoch) starts from zero state, exactly
    as in an uninterrupted run. CheckpointError for a checkpoint of another model.
    """
    prefix = os.path.join(path, "ckpt")
    required = dict(dp_model.checkpoint_state())
    optimizer = required.pop("masked_optimizer")
    try:
        tf.train.Checkpoint(**required).read(prefix).expect_partial().assert_existing_objects_matched()
        tf.train.Checkpoint(masked_optimizer=optimizer).read(prefix).expect_partial()
    except (AssertionError, ValueError, IndexError, KeyError, OSError, tf.errors.OpError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise CheckpointError(f"checkpoint {path} cannot be restored ({first}): it is damaged or belongs to "
                              "another model; resume with the config the run was started with, or start a new "
                              "output_dir") from None


class StepJournal(tf.keras.callbacks.Callback):
    """Before each training step: the journal says the step started, and ``ledger.json`` charges it."""

    def __init__(self, output_dir: str):
        super().__init__()
        self.path = os.path.join(output_dir, CHECKPOINTS, JOURNAL)
        self.ledger_path = os.path.join(output_dir, LEDGER)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def on_train_batch_begin(self, batch, logs=None):
        dp = self.model
        privacy = dp.privacy_callback
        if privacy is not None:  # first the ledger, then the journal: a kill in between over-counts only
            charged = PrivacyLedger.from_json(privacy.ledger.to_json())
            charged.record(privacy.noise_multiplier, privacy.sample_rate, privacy.pending_steps() + 1,
                           privacy.kind, privacy.phase)
            write_atomic(self.ledger_path, json.dumps(charged.to_json(), indent=1))
        write_atomic(self.path, json.dumps({"started_through": int(dp.dp_step.numpy()) + 1}))


def steps_started_after(output_dir: str, checkpoint_step: int) -> int:
    """How many steps this process's journal says a killed run started after ``checkpoint_step``."""
    path = os.path.join(output_dir, CHECKPOINTS, JOURNAL)
    if not os.path.exists(path):
        return 0
    try:
        with open(path) as f:
            started = int(json.load(f)["started_through"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"the step journal {path} is damaged ({error}): the steps the killed run started "
                              "cannot be counted, so it cannot be resumed safely; start a new output_dir") from None
    return max(0, started - checkpoint_step)


def charge_interrupted_steps(output_dir: str, checkpoint_step: int, ledger, noise_multiplier: float,
                             sample_rate: float, strategy: tf.distribute.Strategy) -> int:
    """Records steps run after the last checkpoint by a killed run; returns how many.

    On several workers each keeps its own journal, and a kill leaves them a
    step or two apart; every worker charges the *largest* count
    (``max_w lost_w``), so the ledgers, and with them the step at which the
    privacy budget stops training, are the same on every worker and never
    under-count the steps any worker started.
    """
    lost = distribute.largest_over_workers(strategy, steps_started_after(output_dir, checkpoint_step))
    if lost:
        ledger.record(noise_multiplier, sample_rate, lost, phase="interrupted")
    return lost


def journal_before_training(output_dir: str, ledger, entries: Sequence[LedgerEntry]) -> None:
    """Before mechanisms that draw noise ahead of the first DP step (``entries``: one run's charge):
    writes ``ledger.json`` with them already charged, then counts one more started run, so that no
    kill, during or after them, once or repeatedly, can drop a run from the ledger."""
    if not entries:
        return
    charged = PrivacyLedger.from_json(ledger.to_json())
    for entry in entries:
        charged.record(entry.noise_multiplier, entry.sample_rate, entry.count, entry.kind, entry.phase)
    write_atomic(os.path.join(output_dir, LEDGER), json.dumps(charged.to_json(), indent=1))
    path = os.path.join(output_dir, CHECKPOINTS, BEFORE_TRAINING)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    started = _runs_started_before_training(output_dir) + 1
    write_atomic(path, json.dumps({"runs_started": started, "entries": [e.to_dict() for e in entries]}, indent=1))


def _runs_started_before_training(output_dir: str) -> int:
    path = os.path.join(output_dir, CHECKPOINTS, BEFORE_TRAINING)
    if not os.path.exists(path):
        return 0
    try:
        with open(path) as f:
            return int(json.load(f)["runs_started"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is damaged ({error}): the mechanisms the killed runs started cannot be "
                              "counted, so it cannot be resumed safely; start a new output_dir") from None


def charge_interrupted_before_training(output_dir: str, ledger, planned: Sequence[LedgerEntry],
                                       strategy: tf.distribute.Strategy) -> int:
    """In a run resumed before its first checkpoint: records ``planned`` (one run of the mechanisms
    that draw noise before training; the same config) once for every run the killed runs started
    (the largest count over workers), under the phase ``interrupted``; returns that count. Their
    releases (a mask on disk, the steps that used it) may have been observed, and the resumed run
    runs them again (under a new secret seed unless the config fixes one: then the same draw,
    charged twice, an over-count)."""
    if not planned:
        return 0
    started = distribute.largest_over_workers(strategy, _runs_started_before_training(output_dir))
    for _ in range(started):
        for entry in planned:
            ledger.record(entry.noise_multiplier, entry.sample_rate, entry.count, entry.kind, phase="interrupted")
    return started
