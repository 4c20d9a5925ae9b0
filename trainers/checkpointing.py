"""Per-epoch checkpoints that a killed run resumes from, and the step journal.

``output_dir/checkpoints/epoch-NNNN/`` holds a ``tf.train.Checkpoint`` of the
model weights, the masked optimizer's state, the Keras optimizer's step
counter and the DP step counter, plus ``state.json`` (epoch, seed, ledger).
A checkpoint is written into a temporary directory and renamed, and
``checkpoints/latest`` (the name of the newest complete checkpoint) is
replaced atomically afterwards: a crash at any point leaves the previous
checkpoint as the latest.

The step journal (``checkpoints/journal.json``) records, before every step,
the DP step about to run. After a SIGKILL the steps between the last
checkpoint and the journal were run (their noisy updates may have been
observed), so :func:`charge_interrupted_steps` records them in the ledger
before training resumes: epsilon is never under-counted.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import tensorflow as tf

CHECKPOINTS = "checkpoints"
LATEST = "latest"
JOURNAL = "journal.json"
KEEP = 2


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file, fsync and rename."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(output_dir: str, epoch: int, dp_model, state: dict) -> str:
    """Writes the checkpoint after ``epoch`` (1-based count of finished epochs)."""
    root = os.path.join(output_dir, CHECKPOINTS)
    os.makedirs(root, exist_ok=True)
    name = f"epoch-{epoch:04d}"
    tmp = tempfile.mkdtemp(dir=root, prefix=".partial-")
    tf.train.Checkpoint(**dp_model.checkpoint_state()).write(os.path.join(tmp, "ckpt"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump(dict(state, epoch=epoch), f, indent=1)
    final = os.path.join(root, name)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
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
    if os.path.exists(os.path.join(root, LATEST)):
        with open(os.path.join(root, LATEST)) as f:
            return f"checkpoint {f.read().strip()}"
    if os.path.exists(os.path.join(root, JOURNAL)):
        return "a step journal, no checkpoint yet"
    return None


def latest(output_dir: str) -> tuple[str, dict] | None:
    """``(checkpoint dir, state)`` of the newest complete checkpoint, or None."""
    root = os.path.join(output_dir, CHECKPOINTS)
    pointer = os.path.join(root, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(root, f.read().strip())
    with open(os.path.join(path, "state.json")) as f:
        return path, json.load(f)


def restore(path: str, dp_model) -> None:
    """Restores a checkpoint into a DPModel set up for the phase of the next epoch.

    Weights and counters must all match. Optimizer state is restored for the
    selections the checkpoint has; a selection that starts with this epoch
    (SPARTA's rows after the selection epoch) starts from zero state, exactly
    as in an uninterrupted run.
    """
    prefix = os.path.join(path, "ckpt")
    required = dict(dp_model.checkpoint_state())
    optimizer = required.pop("masked_optimizer")
    tf.train.Checkpoint(**required).read(prefix).expect_partial().assert_existing_objects_matched()
    tf.train.Checkpoint(masked_optimizer=optimizer).read(prefix).expect_partial()


class StepJournal(tf.keras.callbacks.Callback):
    """Writes the DP step about to run before each training step (see module doc)."""

    def __init__(self, output_dir: str):
        super().__init__()
        self.path = os.path.join(output_dir, CHECKPOINTS, JOURNAL)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def on_train_batch_begin(self, batch, logs=None):
        step = int(self.model.dp_step.numpy())
        write_atomic(self.path, json.dumps({"started_through": step + 1}))


def charge_interrupted_steps(output_dir: str, checkpoint_step: int, ledger, noise_multiplier: float,
                             sample_rate: float) -> int:
    """Records steps run after the last checkpoint by a killed run; returns how many."""
    path = os.path.join(output_dir, CHECKPOINTS, JOURNAL)
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        started = json.load(f)["started_through"]
    lost = max(0, started - checkpoint_step)
    if lost:
        ledger.record(noise_multiplier, sample_rate, lost, phase="interrupted")
    return lost
