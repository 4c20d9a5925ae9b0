"""Files written whole or not at all.

A reader, or a run resumed after a SIGKILL, finds the previous version of a
file or the new one, never a truncated one: the text goes to a temporary file
in the same directory (same file system), is flushed and ``fsync``-ed, and
``os.replace`` (atomic on POSIX) puts it in place. A writer killed before the
rename leaves only its temporary, named ``<prefix>*<suffix>``, which the run
directory's owner removes (``trainers.run_dir.STALE_TEMPORARIES``); on any
other error the temporary is removed and the error raised.
"""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str | os.PathLike, text: str, prefix: str = ".tmp-", suffix: str = "") -> None:
    """Writes ``text`` to ``path`` through a temporary file, fsync and rename (no temporary is left)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
