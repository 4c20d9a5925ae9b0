"""How much memory a book-keeping step may keep for its output gradients, and what it kept.

The one-pass step keeps, per layer, its output gradient or its per-example gradients until the clip
factors are known, at most :data:`GRADIENTS_OVER_DELTA` times the output gradient; the two-pass
step (:mod:`~sparta_tf.per_example.streaming`) keeps neither, for one more backward pass.
``max_memory`` (bytes; ``make_private``, ``DPModel``, ``training.max_memory`` in a config) is the
most the one-pass step may keep: above that bound (:func:`one_pass_bound`), the step runs in two
passes. The default is a quarter of what the machine has for the step: the first
GPU's memory where TensorFlow sees one (``nvidia-smi``'s total), else the host's available
memory (``MemAvailable`` in ``/proc/meminfo``), else 4 GiB.
"""

from __future__ import annotations

import functools
import math
import pathlib
import shutil
import subprocess
from typing import NamedTuple

import tensorflow as tf

from sparta_tf.backend import owned_variables
from sparta_tf.keras_layers import all_layers

DEFAULT_FRACTION = 0.25
"""The share of the machine's memory the one-pass step's output gradients may take by default."""

FALLBACK_BYTES = 4 * 2**30
"""The default budget's base when neither a GPU's nor the host's memory can be read."""


GRADIENTS_OVER_DELTA = 1.25
"""A one-pass tap keeps its layer's per-example gradients up to this many times the bytes of its
output gradient: their clipped sum is then a ``B``-term dot product instead of the layer's weight
gradient of ``c * delta`` (for ResNet-20-GN's 16x16 convolutions, 4.7 MB of per-example gradients
against 4.2 MB of output gradient at ``B = 128``, a filter gradient of about 3 ms saved per layer
on 2 CPU cores)."""


def one_pass_bound(output_gradients: int | None) -> int | None:
    """The most one pass keeps, given the bytes of every output gradient it records (None: unknown)."""
    return None if output_gradients is None else math.ceil(GRADIENTS_OVER_DELTA * output_gradients)


class MemoryPlan(NamedTuple):
    """How a traced step keeps its output gradients (bytes; None where a shape is unknown when traced)."""

    mode: str  # "one_pass" or "two_pass"
    budget: int  # max_memory
    one_pass_bytes: int | None  # the most one pass keeps: one_pass_bound of every recorded output gradient
    kept_bytes: int | None  # what this step keeps: untapped calls' output gradients, and what one-pass taps kept


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


def output_gradient_bytes(model: tf.keras.Model, batch: int) -> int | None:
    """Before any step: what a one-pass step over every weight of ``model`` keeps at a physical
    ``batch``: the output gradient of every call of every layer that owns weights (4 bytes a
    coordinate; the output of a layer's ``convolution_op`` or pre-activation has its output's shape).
    None for a model whose layers' output shapes are not known before a call (a subclassed model)."""
    total = 0
    for layer in all_layers(model):
        if not owned_variables(layer):
            continue
        nodes = getattr(layer, "_inbound_nodes", None) or []
        if not nodes:
            return None
        for node in nodes:
            outputs = getattr(node, "output_tensors", None)
            outputs = getattr(node, "outputs", []) if outputs is None else outputs
            for output in tf.nest.flatten(outputs):
                shape = getattr(output, "shape", None)
                if shape is None or None in tuple(shape)[1:]:
                    return None
                total += batch * int(math.prod(tuple(shape)[1:])) * 4
    return total


def step_budget(max_memory: int | None, reserved: int = 0) -> int:
    """What the one-pass step may keep: ``max_memory`` (None: :func:`default_memory_budget`) less the
    ``reserved`` bytes other state of the step holds for the whole run (correlated noise's buffered
    draws, :mod:`sparta_tf.dp_step.correlated_noise`), at least 0."""
    budget = default_memory_budget() if max_memory is None else int(max_memory)
    return max(0, budget - int(reserved))


def describe(model: tf.keras.Model, batch: int, max_memory: int | None, reserved: int = 0) -> str:
    """The dry run's line on the book-keeping step's memory: what one pass keeps and whether it fits in
    ``max_memory`` less ``reserved`` (the correlated noise's buffer, :func:`step_budget`)."""
    budget = step_budget(max_memory, reserved)
    kept = one_pass_bound(output_gradient_bytes(model, batch))
    source = "max_memory" if max_memory is not None else "default max_memory (a quarter of the machine's memory)"
    if reserved:
        source += f", less {_mib(reserved)} of buffered correlated noise"
    if kept is None:
        return (f"memory: what one pass keeps is known when the step is traced "
                f"(DPModel.engine_memory_plan()); budget {_mib(budget)} ({source})")
    mode = "one pass" if kept <= budget and budget > 0 else "two backward passes, keeping none"
    return (f"memory: one pass keeps at most {_mib(kept)} of layer output or per-example gradients at a "
            f"physical batch of {batch}; budget {_mib(budget)} ({source}): {mode}")


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"
