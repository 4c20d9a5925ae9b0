"""A file written through ``write_atomic`` or ``replace_atomically`` is the old one or the new one,
never part of either."""

import errno
import os

import numpy as np
import pytest

from sparta_tf import atomic_files
from sparta_tf.atomic_files import replace_atomically, write_atomic


def test_writes_the_text_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "deeper" / "ledger.json"  # a missing directory is made
    write_atomic(path, "{}\n")
    write_atomic(path, '{"steps": 2}\n', prefix=".ledger-", suffix=".tmp")
    assert path.read_text() == '{"steps": 2}\n'
    assert os.listdir(path.parent) == ["ledger.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_atomic(path, "old")

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_files.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_writer_that_fills_a_path_gets_a_temporary_with_the_suffix_it_needs(tmp_path):
    path = tmp_path / "arrays.npz"
    seen = []

    def save(tmp):
        seen.append(tmp)
        with open(tmp, "wb") as f:
            np.savez(f, rows=np.arange(3))

    replace_atomically(path, save, suffix=".npz")
    assert os.path.basename(seen[0]).startswith(".tmp-") and seen[0].endswith(".npz")
    assert np.load(path)["rows"].tolist() == [0, 1, 2]
    assert os.listdir(tmp_path) == ["arrays.npz"]


def test_a_writer_that_fails_halfway_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "model.keras"
    path.write_text("old model")

    def crash_halfway(tmp):
        with open(tmp, "w") as f:
            f.write("half a mod")
        raise KeyboardInterrupt  # a BaseException, as an interrupted save raises

    with pytest.raises(KeyboardInterrupt):
        replace_atomically(path, crash_halfway, suffix=".keras")
    assert path.read_text() == "old model"
    assert os.listdir(tmp_path) == ["model.keras"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_file_gets_the_mode_a_plain_open_would_give_it(tmp_path, umask):
    previous = os.umask(umask)
    try:
        write_atomic(tmp_path / "atomic.json", "{}")
        with open(tmp_path / "plain.json", "w") as f:
            f.write("{}")
    finally:
        os.umask(previous)
    mode = lambda name: os.stat(tmp_path / name).st_mode & 0o777  # noqa: E731
    assert mode("atomic.json") == mode("plain.json") == 0o666 & ~umask
