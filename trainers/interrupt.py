"""Ctrl-C in the command-line tools: one line on stderr saying what stopped and how to continue, exit status 130.

Python turns SIGINT into a ``KeyboardInterrupt`` wherever the tool is (importing
TensorFlow, loading data, inside ``fit``, waiting on a child process); left
alone it ends the tool with a traceback. Every tool (``sparta-train``,
``sparta-tune``, ``sparta-example``, ``sparta-check-export``, ``sparta-audit``)
runs its work through :func:`stop_on_ctrl_c`, with a line of its own: what the
interrupted work had written, and whether it can be resumed.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["INTERRUPTED", "stop_on_ctrl_c"]

INTERRUPTED = 130
"""Exit status after Ctrl-C (SIGINT), the shell's 128 + 2."""


def stop_on_ctrl_c(work: Callable[[], int], line: Callable[[], str]) -> int:
    """``work()``'s exit status; when Ctrl-C interrupts it, ``line()`` (computed then, so that it can say
    how far the work got) on stderr and :data:`INTERRUPTED`."""
    try:
        return work()
    except KeyboardInterrupt:
        print(line(), file=sys.stderr)
        return INTERRUPTED
