"""Files written whole or not at all.

A reader, or a run resumed after a SIGKILL, finds the previous version of a
file or the new one, never a truncated one: the content goes to a temporary
file in the same directory (same file system), is ``fsync``-ed, and
``os.replace`` (atomic on POSIX) puts it in place. A writer killed before the
rename leaves only its temporary, named ``<prefix>*<suffix>``, which the run
directory's owner removes (``trainers.run_dir.STALE_TEMPORARIES``); on any
other error the temporary is removed and the error raised. The file gets the
mode a plain ``open`` would give it (0o666 less the umask), not the 0o600 of
``mkstemp``: a shared pre-trained model or cache stays readable, and a
restrictive umask still holds.

:func:`replace_atomically` takes any writer that fills a path (``np.savez``,
``model.save``); :func:`write_atomic` is its form for text.
"""

from __future__ import annotations

import os
import secrets
from typing import Callable


def replace_atomically(path: str | os.PathLike, write: Callable[[str], None], prefix: str = ".tmp-",
                       suffix: str = "") -> None:
    """Puts at ``path`` the file that ``write(temporary)`` fills: temporary file, fsync, rename.

    ``write`` receives the temporary's path (an empty file in ``path``'s
    directory, named ``<prefix>*<suffix>``) and must leave the whole content
    there; no temporary is left, whatever ``write`` raises.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = _new_temporary(directory, prefix, suffix)
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_atomic(path: str | os.PathLike, text: str, prefix: str = ".tmp-", suffix: str = "") -> None:
    """Writes ``text`` to ``path`` whole or not at all (:func:`replace_atomically`)."""

    def write_text(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    replace_atomically(path, write_text, prefix=prefix, suffix=suffix)


def _fsync(path: str) -> None:
    """Flushes ``path``'s content to the disk (whoever wrote it has closed it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_temporary(directory: str, prefix: str, suffix: str) -> str:
    """A new empty file ``<prefix><8 random hex digits><suffix>`` in ``directory``, created (like
    ``mkstemp``, exclusively) with the mode ``open`` gives: 0o666 less the umask, which the kernel
    applies (``mkstemp`` would make it 0o600)."""
    while True:
        tmp = os.path.join(directory, f"{prefix}{secrets.token_hex(4)}{suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
