"""One owner per run directory: a lock, and no mixing of a new run with a killed one's state.

``output_dir`` belongs to one ``sparta-train`` process at a time: it holds an
exclusive ``flock`` on ``output_dir/.lock`` (released by the kernel when the
process dies, even by SIGKILL), and a second process is refused at once.

A fresh start (no ``--resume``) is refused in a directory that holds a
killed run's state (checkpoints or the step journal): mixing the two would
let ``--resume`` pick up the first run's checkpoint with the second run's
journal and under-count the first run's steps. ``--resume`` continues the
killed run, and only with the config it was started with.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import tempfile

from sparta_tf import checkpointing
from trainers.config import ConfigError, validate
from trainers.split_key import recorded_data

LOCK_FILE = ".lock"
RESULTS = "results.json"
CONFIG = "config.json"
STALE_TEMPORARIES = (".tmp-*", "*.tmp.keras", ".ledger-*.tmp", "checkpoints/.partial-*", "checkpoints/.tmp-*",
                     "export/.tmp-export-*", "mask/.tmp-*", "mask/*.tmp-*", ".release-*", ".winner-*")
"""What a killed writer leaves behind (atomic writes go through these names first; ``.release-*``: a
tuning's release being written, :mod:`sparta_tf.tuning.release`; ``*.tmp.keras``
and ``mask/*.tmp-*`` are the names versions before ``replace_atomically`` used)."""


def check_output_dir(path: str) -> None:
    """A ConfigError unless ``path`` is, or can be created as, a writable directory (leaves nothing behind).

    Permission bits do not tell everything (root may write anywhere by them, yet ``/proc`` or a read-only
    mount refuse), so the deepest existing directory is tried: a probe directory is made in it and removed.
    """
    target = os.path.abspath(path)
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == target else f"cannot be created: {existing} is a file"
        raise ConfigError(f"output_dir {path} {where}; choose a directory path")
    problem = None if os.access(existing, os.W_OK | os.X_OK) else "not writable"
    if problem is None:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".sparta-probe-", dir=existing))
        except OSError as error:
            problem = f"not writable: making a directory there fails with {error.strerror or error}"
    if problem is not None:
        where = f"is {problem}" if existing == target else f"cannot be created in {existing} ({problem})"
        raise ConfigError(f"output_dir {path} {where}; choose a writable path")


class RunDirectory:
    """The locked ``output_dir`` of one run (a context manager)."""

    def __init__(self, path: str, config: dict, resume: bool):
        self.path, self.config, self.resume = path, config, resume
        self._lock = None

    def __enter__(self) -> "RunDirectory":
        check_output_dir(self.path)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"output_dir {self.path} cannot be created ({error.strerror}); choose a writable "
                              "path") from None
        self._acquire()
        try:
            self._check_state()
            self.remove_stale_temporaries()
        except BaseException:
            self._release()
            raise
        return self

    def remove_stale_temporaries(self) -> list[str]:
        """Deletes what killed writers left (this process owns the directory); returns the paths."""
        removed = []
        for pattern in STALE_TEMPORARIES:
            for path in glob.glob(os.path.join(glob.escape(self.path), pattern)):
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)
                removed.append(path)
        return removed

    def __exit__(self, *exc) -> None:
        self._release()

    def _acquire(self) -> None:
        path = os.path.join(self.path, LOCK_FILE)
        try:
            handle = open(path, "a+")
        except OSError as error:
            raise ConfigError(f"output_dir {self.path} is not writable ({error.strerror}); choose another "
                              "output_dir") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "?"
            handle.close()
            raise ConfigError(f"output_dir {self.path} is in use by another sparta-train (pid {owner}); wait for "
                              "it to finish or choose another output_dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._lock = handle

    def _release(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def _check_state(self) -> None:
        if os.path.exists(os.path.join(self.path, RESULTS)) and not self.resume:
            raise ConfigError(f"output_dir {self.path} already holds a finished run; choose a new output_dir")
        if os.path.exists(os.path.join(self.path, RESULTS)):
            raise ConfigError(f"output_dir {self.path} holds a finished run: there is nothing to resume")
        interrupted = checkpointing.has_state(self.path)
        if interrupted and not self.resume:
            raise ConfigError(f"output_dir {self.path} holds an interrupted run ({interrupted}); pass --resume to "
                              "continue it, or choose a new output_dir")
        if interrupted:
            self._check_same_config()

    def _check_same_config(self) -> None:
        path = os.path.join(self.path, CONFIG)
        if not os.path.exists(path):
            return
        with open(path) as f:
            recorded = json.load(f)
        if isinstance(recorded.get("data"), dict):
            recorded["data"] = recorded_data(recorded["data"])
        before = _with_current_defaults(recorded)
        for section in ("data", "model", "pretrain", "method", "privacy", "training"):
            if before.get(section) != self.config.get(section):
                hint = (" (it split its data by positions: set data.split: positions)"
                        if section == "data" and before["data"].get("split") != self.config["data"].get("split") else "")
                raise ConfigError(f"--resume: the interrupted run in {self.path} was started with another "
                                  f"{section} section{hint}; resume it with the config it was started with")

    def write_config(self) -> None:
        """Records the run's config (a resumed run keeps the one it was started with)."""
        path = os.path.join(self.path, CONFIG)
        if not (self.resume and os.path.exists(path)):
            checkpointing.write_atomic(path, json.dumps(self.config, indent=1))


def _with_current_defaults(config: dict) -> dict:
    """A run's recorded config validated again, so that a key added to the schema since the run
    started (recorded without it) compares equal to its default; as recorded if it no longer validates."""
    try:
        return validate(config)
    except ConfigError:
        return config
