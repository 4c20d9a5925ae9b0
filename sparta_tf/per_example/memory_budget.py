"""How much memory a book-keeping step may keep for its output gradients, and what it kept.

The one-pass step keeps every layer's output gradient until the clip factors are known (about the
activations' memory again); the two-pass step (:mod:`~sparta_tf.per_example.streaming`) keeps
none, for one more backward pass. ``max_memory`` (bytes; ``make_private``, ``DPModel``,
``training.max_memory`` in a config) is the most the one-pass step may keep: above it, the step
runs in two passes. The default is a quarter of what the machine has for the step: the first
GPU's memory where TensorFlow sees one (``nvidia-smi``'s total), else the host's available
memory (``MemAvailable`` in ``/proc/meminfo``), else 4 GiB.
"""

from __future__ import annotations

import functools
import pathlib
import shutil
import subprocess
from typing import NamedTuple

import tensorflow as tf

DEFAULT_FRACTION = 0.25
"""The share of the machine's memory the one-pass step's output gradients may take by default."""

FALLBACK_BYTES = 4 * 2**30
"""The default budget's base when neither a GPU's nor the host's memory can be read."""


class MemoryPlan(NamedTuple):
    """How a traced step keeps its output gradients (bytes; None where a shape is unknown when traced)."""

    mode: str  # "one_pass" or "two_pass"
    budget: int  # max_memory
    one_pass_bytes: int | None  # what one pass would keep: every recorded call's output gradient
    kept_bytes: int | None  # what this step keeps: the output gradients of the calls it does not tap


@functools.lru_cache(maxsize=1)
def default_memory_budget() -> int:
    """``DEFAULT_FRACTION`` of the first GPU's memory, else of the host's available memory (bytes)."""
    return int(DEFAULT_FRACTION * (_gpu_bytes() or _available_host_bytes() or FALLBACK_BYTES))


def _gpu_bytes() -> int | None:
    """The first visible GPU's total memory from ``nvidia-smi`` (None without a GPU or the tool)."""
    if not tf.config.list_physical_devices("GPU") or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(float(out.split()[0]) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _available_host_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none)."""
    try:
        lines = pathlib.Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    line = next((ln for ln in lines if ln.startswith("MemAvailable:")), None)
    return int(line.split()[1]) * 1024 if line else None
