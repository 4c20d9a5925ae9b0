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

The step journal (``checkpoints/journal.json``), ``checkpoints/before_training.json``
and ``ledger.json`` are the privacy side of the run directory: how the steps a
killed run started are charged is :mod:`sparta_tf.privacy.charging`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import tensorflow as tf

from sparta_tf.atomic_files import write_atomic
from sparta_tf.privacy.ledger import PrivacyLedger

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


OPTIONAL_STATE = ("public_seed",)
"""Checkpoint entries a checkpoint may lack: one written before the DP model had them keeps the value it
was built with (``private_model`` passes the run state's ``public_seed``, or the run seed, which such a
run used for its public streams)."""


def restore(path: str, dp_model) -> None:
    """Restores a checkpoint into a DPModel set up for the phase of the next epoch.

    Weights and counters must all match. Optimizer state (and BandMF's buffered
    noise) is restored for the selections the checkpoint has; a selection that
    starts with this epoch (SPARTA's rows after the selection epoch) starts from
    zero state, exactly as in an uninterrupted run. CheckpointError for a checkpoint of another model.
    """
    prefix = os.path.join(path, "ckpt")
    required = dict(dp_model.checkpoint_state())
    per_selection = {name: required.pop(name) for name in ("masked_optimizer", "correlated_noise") if name in required}
    optional = {name: required.pop(name) for name in OPTIONAL_STATE if name in required}
    try:
        tf.train.Checkpoint(**required).read(prefix).expect_partial().assert_existing_objects_matched()
        tf.train.Checkpoint(**per_selection, **optional).read(prefix).expect_partial()
    except (AssertionError, ValueError, IndexError, KeyError, OSError, tf.errors.OpError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise CheckpointError(f"checkpoint {path} cannot be restored ({first}): it is damaged or belongs to "
                              "another model; resume with the config the run was started with, or start a new "
                              "output_dir") from None
