"""Image arrays are checked against the memory available before they are allocated.

A data set that cannot fit (e.g. ``image_size: [100000, 100000]``) is a
one-line :class:`DataError` naming the key, not NumPy's ``MemoryError``
traceback after minutes of swapping. Available memory is Linux's
``MemAvailable`` (``/proc/meminfo``), lowered to what a cgroup v2 memory
limit leaves; where neither can be read the check passes.
"""

from __future__ import annotations

import os
from typing import Optional

from sparta_tf.data.errors import key_error

__all__ = ["available_memory_bytes", "check_fits_in_memory"]

GIB = 2.0**30


def available_memory_bytes() -> Optional[int]:
    """Bytes of memory this process may still allocate, or None when unknown."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            left = max(0, int(limit) - current)
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    if available is None and hasattr(os, "sysconf"):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pass
    return available


def check_fits_in_memory(needed_bytes: float, key: str, what: str, fix: str) -> None:
    """A :class:`DataError` (``data.<key>: <what> needs X GiB, more than the Y GiB of memory available;
    <fix>``) unless ``needed_bytes`` fit in :func:`available_memory_bytes`."""
    available = available_memory_bytes()
    if available is not None and needed_bytes > available:
        raise key_error(key, f"{what} needs {_gib(needed_bytes)}, more than the {_gib(available)} of memory "
                        "available", fix)


def _gib(size: float) -> str:
    gib = size / GIB
    return f"{gib:,.0f} GiB" if gib >= 100 else f"{gib:.3g} GiB"
