"""Keeping the command-line tools' stderr to what the user needs (one line for a user error).

:func:`import_tensorflow` -- importing TensorFlow without the lines its C++ libraries print before
logging is set up:

TensorFlow >= 2.16 (e.g. 2.21) logs through absl, and absl writes everything
logged before ``absl::InitializeLog()`` to stderr whatever
``TF_CPP_MIN_LOG_LEVEL`` says: each ``import tensorflow`` prints
``WARNING: All log messages before absl::InitializeLog() is called are written
to STDERR`` and informational lines (oneDNN, "Could not find cuda drivers").
The command-line tools promise one line on stderr for a user error, so while
the user asks for quiet C++ logs (``TF_CPP_MIN_LOG_LEVEL`` >= 1, which the
tools set by default) the import runs with file descriptor 2 pointed at
``/dev/null``. Python errors raised by the import are reported after stderr is
back; TensorFlow 2.15 prints nothing there, so nothing changes on it.

dp-accounting 0.6's notes on the Renyi orders it leaves out (``_compute_log_a_frac failed to converge
... Excluding this order``) are dropped by the library itself, for the tools as for a library user:
:func:`sparta_tf.privacy.accounting.drop_rdp_convergence_notes`, installed whenever it makes an RDP
accountant.
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["import_tensorflow"]


def _quiet_requested() -> bool:
    """True when ``TF_CPP_MIN_LOG_LEVEL`` asks for less than INFO from TensorFlow's C++ code."""
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip()
    return level.isdigit() and int(level) >= 1


@contextlib.contextmanager
def _stderr_fd_silenced():
    """File descriptor 2 (what C++ writes to) points at /dev/null inside the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def import_tensorflow():
    """``import tensorflow``, silencing the C++ start-up lines when TF_CPP_MIN_LOG_LEVEL >= 1."""
    if "tensorflow" in sys.modules or not _quiet_requested():
        import tensorflow

        return tensorflow
    with _stderr_fd_silenced():
        import tensorflow
    return tensorflow
