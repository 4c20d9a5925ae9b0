"""A file written through ``write_atomic`` is the old one or the new one, never part of either."""

import errno
import os

import pytest

from sparta_tf import atomic_files
from sparta_tf.atomic_files import write_atomic


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
