#!/usr/bin/env python
"""Steady-state training-step time: non-private vs DP, Keras vs TF Privacy vs Opacus.

Model: ResNet-20-GN (``sparta_tf.models.resnet20_gn``; its PyTorch twin in
``benchmarks/torch_resnet.py`` for the torch variants, with the same initial
weights). Data: random CIFAR-shaped batches (32x32x3, 10 classes), a pool of
4 distinct batches cycled through. Optimiser: SGD(lr 0.01, momentum 0.9)
everywhere; DP variants use clip norm 1 and noise multiplier 1.

Method. All variants of one batch size are built in ONE process, warmed up
(tracing / XLA compilation / hook installation are reported separately as
``setup_s``), then timed **interleaved**: ``--rounds`` rounds, each running
every variant in turn (start rotated every round) for its share of
``--steps`` timed steps, preceded by ``--reentry`` untimed steps so that
thread-pool spin-down and cache effects from the previous variant are not
charged to it. Machine noise therefore hits all variants alike; we report the
median and the interquartile range of the per-step times. Each step is timed
from call to host-synchronised loss (``perf_counter``).

TensorFlow steps run the *fit path*: ``model.make_train_function()`` (the
``tf.function`` that ``Model.fit`` calls per step) fed from one persistent
``tf.data`` iterator. ``train_on_batch`` is deliberately not used: on the
2-core dev machine its step times snap to 10*(2^k-1) ms (tf.data autotune
sleeps; see shared/DESIGN.md).

Variants (names are what ``--skip`` / ``--only`` match, shell-style globs):

  keras              non-private Keras step (the reference for all ratios)
  sparta             OUR DP step, ``sparta_tf.DPModel`` (see make_sparta_dp_step)
  tfp-vectorized     TF Privacy VectorizedDPKerasSGDOptimizer, one microbatch
                     per example (tape.jacobian: O(B^2); "slow")
  tfp-dpmodel        TF Privacy make_dp_model_class(tf.keras.Model), use_xla=False
  tfp-dpmodel-xla    the same with use_xla=True (its default; XLA on CPU is slow)
  torch              PyTorch non-private step (same architecture and weights)
  opacus-hooks       Opacus PrivacyEngine, grad_sample_mode="hooks"
  opacus-ew          Opacus, grad_sample_mode="ew" (expanded weights; optional)
  opacus-functorch   Opacus, grad_sample_mode="functorch" (vmap; optional)
  opacus-ghost       Opacus, grad_sample_mode="ghost" (ghost clipping; optional)

Torch variants are skipped with a note when torch/opacus do not import.
Variants marked slow run at most ``--slow-steps`` timed steps and are skipped
above ``--slow-max-batch``.

Adding a variant is one line in :data:`VARIANTS`: a name, a factory
``factory(model, batch_size, ctx) -> step`` where ``model`` is a fresh,
identically initialised Keras ResNet-20-GN and ``step()`` runs one full
training step and returns the loss as a Python float; raise
:class:`VariantUnavailable` to skip with a note.

TF's log is captured: pfor's "Using a while_loop for converting <Op>" notices
(per-example gradients that ``vectorized_map`` could not vectorise and runs as
a loop over examples) are listed per variant in the output.

Examples::

    python benchmarks/step_time.py --smoke                  # CI: ~1 min on 2 quiet cores
    python benchmarks/step_time.py --batch-sizes 64 256 --steps 20 --warmup 3
    python benchmarks/step_time.py --skip 'tfp-vectorized' 'opacus-*'
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import gc
import importlib
import importlib.util
import json
import logging
import math
import os
import pathlib
import platform
import re
import socket
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import sparta_tf  # noqa: E402,F401  (first: checks the Keras behind tf.keras)
import tensorflow as tf  # noqa: E402

from sparta_tf.models import resnet20_gn  # noqa: E402

IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
POOL = 4  # distinct random batches cycled through
LR = 0.01
MOMENTUM = 0.9
CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0


class VariantUnavailable(Exception):
    """Raised by a factory to skip its variant with a printed note."""


@dataclasses.dataclass
class Ctx:
    """What factories may need besides the model and batch size."""

    dataset_size: int
    threads: int
    seed: int = 0
    jit_compile: bool = False  # XLA for the TF steps (``compile(jit_compile=...)``)


Step = Callable[[], float]
Factory = Callable[[tf.keras.Model, int, Ctx], Step]


@dataclasses.dataclass
class Variant:
    name: str
    factory: Factory
    description: str
    family: str = "tf"  # "tf" or "torch": the torch ones are compared to "torch" too
    slow: bool = False


# ---------------------------------------------------------------------------
# Shared TF helpers
# ---------------------------------------------------------------------------


def _random_pool(batch_size: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.random((POOL, batch_size) + IMAGE_SHAPE, dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=(POOL, batch_size)).astype(np.int32)
    return x, y


def _tf_dataset(batch_size: int, seed: int, with_weights: bool = False) -> tf.data.Dataset:
    """An endless dataset of full batches ``(x, y)`` or ``(x, y, w=1)``."""
    x, y = _random_pool(batch_size, seed)
    if with_weights:
        w = np.ones((POOL, batch_size), np.float32)
        ds = tf.data.Dataset.from_tensor_slices((x, y, w))
    else:
        ds = tf.data.Dataset.from_tensor_slices((x, y))
    return ds.repeat()


def _fit_path_step(model: tf.keras.Model, ds: tf.data.Dataset) -> Step:
    """One ``Model.fit`` step per call: the compiled train function + one iterator."""
    iterator = iter(ds)
    train_function = model.make_train_function()

    def step() -> float:
        logs = train_function(iterator)
        values = [v for v in tf.nest.flatten(logs)]
        return float(values[0]) if values else float("nan")

    return step


def _sgd():
    return tf.keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)


def _xent(reduction=tf.keras.losses.Reduction.AUTO):
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


# ---------------------------------------------------------------------------
# (a) non-private Keras step
# ---------------------------------------------------------------------------


def make_keras_step(model: tf.keras.Model, batch_size: int, ctx: Ctx) -> Step:
    model.compile(optimizer=_sgd(), loss=_xent(), jit_compile=ctx.jit_compile)
    return _fit_path_step(model, _tf_dataset(batch_size, ctx.seed))


# ---------------------------------------------------------------------------
# (b) OUR DP step  --  >>> TO BE WIRED BY THE LEAD <<<
# ---------------------------------------------------------------------------


def make_sparta_dp_step(model: tf.keras.Model, batch_size: int, ctx: Ctx) -> Step:
    """OUR DP-SGD step: ``sparta_tf.DPModel`` on the fit path.

    ``sparta_tf.DPModel(model, clip_norm=1.0, noise_multiplier=1.0,
    sample_rate=q, dataset_size=n, engine=...)`` compiled like a Keras model;
    its ``train_step(data)`` takes ``(x, y, sample_weight)``. Full-size
    batches with weight 1 are fed (no Poisson padding: this times the step,
    not the sampler); ``q = batch_size / dataset_size``.
    """
    return _sparta_step(model, batch_size, ctx, engine="auto")


def make_sparta_vectorized_step(model: tf.keras.Model, batch_size: int, ctx: Ctx) -> Step:
    """OUR DP-SGD step with the generic ``tf.vectorized_map`` engine."""
    return _sparta_step(model, batch_size, ctx, engine="vectorized")


def make_sparta_selection_step(model: tf.keras.Model, batch_size: int, ctx: Ctx) -> Step:
    """A SPARTA selection-epoch step: private row scores of every kernel, no weight update."""
    from sparta_tf.selection import SpartaSelector

    def configure(dp_model):
        scorer = SpartaSelector(model, density=0.2).make_scorer(dp_model.mechanism)
        dp_model.begin_scoring(scorer)

    return _sparta_step(model, batch_size, ctx, engine="auto", configure=configure)


def _make_sparta_sparse_step(density: float) -> Factory:
    def factory(model: tf.keras.Model, batch_size: int, ctx: Ctx) -> Step:
        """A SPARTA sparse-phase step: ``density`` of the rows of every kernel + biases/norms/head.

        The rows are a seeded random subset per layer (same cost as a selected mask).
        """
        from sparta_tf import methods
        from sparta_tf.groups import row_groups
        from sparta_tf.selection import random_selections

        def configure(dp_model):
            mask = random_selections(row_groups(model), density, "row", seed=ctx.seed)
            dp_model.set_trainable_set(methods.trainable_set(model, "random", mask))

        return _sparta_step(model, batch_size, ctx, engine="auto", configure=configure)

    return factory


def _sparta_step(model: tf.keras.Model, batch_size: int, ctx: Ctx, engine: str, configure=None) -> Step:
    from sparta_tf import DPModel

    dp_model = DPModel(
        model,
        clip_norm=CLIP_NORM,
        noise_multiplier=NOISE_MULTIPLIER,
        sample_rate=batch_size / ctx.dataset_size,
        dataset_size=ctx.dataset_size,
        engine=engine,
    )
    dp_model.compile(optimizer=_sgd(), loss=_xent(), jit_compile=ctx.jit_compile)
    if configure is not None:
        configure(dp_model)
    return _fit_path_step(dp_model, _tf_dataset(batch_size, ctx.seed, with_weights=True))


# ---------------------------------------------------------------------------
# (c) TF Privacy VectorizedDPKerasSGDOptimizer
# ---------------------------------------------------------------------------


def require_tf_privacy() -> None:
    """Skips a TF Privacy variant with a note where TF Privacy is not installed (the TF 2.21 line)."""
    if importlib.util.find_spec("tensorflow_privacy") is None:
        raise VariantUnavailable("TF Privacy is not installed: it runs on the TF 2.15 line only "
                                 "(Python 3.11, pip install -e '.[benchmark]')")


def make_tfp_vectorized_step(model: tf.keras.Model, batch_size: int, ctx: Ctx) -> Step:
    require_tf_privacy()
    from tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_vectorized import (
        VectorizedDPKerasSGDOptimizer,
    )

    opt = VectorizedDPKerasSGDOptimizer(
        l2_norm_clip=CLIP_NORM,
        noise_multiplier=NOISE_MULTIPLIER,
        num_microbatches=batch_size,
        learning_rate=LR,
        momentum=MOMENTUM,
    )
    # Per-example (vector) loss, as TF Privacy's Keras optimizers require.
    model.compile(optimizer=opt, loss=_xent(tf.keras.losses.Reduction.NONE))
    return _fit_path_step(model, _tf_dataset(batch_size, ctx.seed))


# ---------------------------------------------------------------------------
# (d) TF Privacy DPModel (make_dp_model_class), with and without XLA
# ---------------------------------------------------------------------------


def _make_tfp_dpmodel_step(use_xla: bool) -> Factory:
    def factory(model: tf.keras.Model, batch_size: int, ctx: Ctx) -> Step:
        require_tf_privacy()
        from tensorflow_privacy.privacy.keras_models.dp_keras_model import make_dp_model_class

        DPModel = make_dp_model_class(tf.keras.Model)
        dp_model = DPModel(
            l2_norm_clip=CLIP_NORM,
            noise_multiplier=NOISE_MULTIPLIER,
            num_microbatches=None,  # one per example
            use_xla=use_xla,
            inputs=model.inputs,
            outputs=model.outputs,
        )
        dp_model.compile(optimizer=_sgd(), loss=_xent())
        return _fit_path_step(dp_model, _tf_dataset(batch_size, ctx.seed))

    return factory


# ---------------------------------------------------------------------------
# (e) PyTorch and Opacus (same architecture, weights copied from the Keras model)
# ---------------------------------------------------------------------------


def _import_torch():
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        raise VariantUnavailable(f"torch does not import ({type(e).__name__}: {e})") from e
    return torch


def _torch_setup(model: tf.keras.Model, batch_size: int, ctx: Ctx):
    torch = _import_torch()
    import torch_resnet

    torch.manual_seed(ctx.seed)
    net = torch_resnet.load_keras_weights(torch_resnet.resnet20_gn(), model)
    net.train()
    x, y = _random_pool(batch_size, ctx.seed)
    xs = [torch.from_numpy(np.ascontiguousarray(b.transpose(0, 3, 1, 2))) for b in x]
    ys = [torch.from_numpy(b.astype(np.int64)) for b in y]
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    return torch, net, opt, xs, ys


def _torch_loop(torch, net, opt, xs, ys, criterion) -> Step:
    counter = [0]

    def step() -> float:
        i = counter[0] % POOL
        counter[0] += 1
        opt.zero_grad(set_to_none=True)
        loss = criterion(net(xs[i]), ys[i])
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def make_torch_step(model: tf.keras.Model, batch_size: int, ctx: Ctx) -> Step:
    torch, net, opt, xs, ys = _torch_setup(model, batch_size, ctx)
    return _torch_loop(torch, net, opt, xs, ys, torch.nn.CrossEntropyLoss())


def _make_opacus_step(mode: str) -> Factory:
    def factory(model: tf.keras.Model, batch_size: int, ctx: Ctx) -> Step:
        torch, net, opt, xs, ys = _torch_setup(model, batch_size, ctx)
        try:
            from opacus import PrivacyEngine
        except Exception as e:
            raise VariantUnavailable(f"opacus does not import ({type(e).__name__}: {e})") from e
        from torch.utils.data import DataLoader, TensorDataset

        # The data loader only tells Opacus the batch size / sample rate; the
        # timed step feeds the same tensors as the non-private torch step.
        loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=batch_size)
        engine = PrivacyEngine(accountant="rdp")
        criterion = torch.nn.CrossEntropyLoss()
        out = engine.make_private(
            module=net,
            optimizer=opt,
            criterion=criterion,
            data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=CLIP_NORM,
            poisson_sampling=False,
            grad_sample_mode=mode,
        )
        if mode == "ghost":
            net, opt, criterion, _ = out
        else:
            net, opt, _ = out
        return _torch_loop(torch, net, opt, xs, ys, criterion)

    return factory


# ---------------------------------------------------------------------------
# The registry: one line per variant
# ---------------------------------------------------------------------------

VARIANTS: List[Variant] = [
    Variant("keras", make_keras_step, "Keras non-private (fit-path tf.function)"),
    Variant("sparta", make_sparta_dp_step, "sparta_tf.DPModel (ours, default engine: book-keeping)"),
    Variant("sparta-selection", make_sparta_selection_step, "ours: SPARTA selection-epoch step (row scores, no update)"),
    Variant("sparta-sparse-20", _make_sparta_sparse_step(0.20), "ours: SPARTA sparse phase, 20% of rows"),
    Variant("sparta-sparse-1", _make_sparta_sparse_step(0.01), "ours: SPARTA sparse phase, 1% of rows"),
    Variant("sparta-vmap", make_sparta_vectorized_step, "sparta_tf.DPModel (ours, vectorized_map engine)"),
    Variant("tfp-vectorized", make_tfp_vectorized_step,
            "TF Privacy VectorizedDPKerasSGDOptimizer, B microbatches", slow=True),
    Variant("tfp-dpmodel", _make_tfp_dpmodel_step(False), "TF Privacy DPModel, use_xla=False"),
    Variant("tfp-dpmodel-xla", _make_tfp_dpmodel_step(True), "TF Privacy DPModel, use_xla=True"),
    Variant("torch", make_torch_step, "PyTorch non-private", family="torch"),
    Variant("opacus-hooks", _make_opacus_step("hooks"), "Opacus, grad_sample_mode=hooks", family="torch"),
    Variant("opacus-ew", _make_opacus_step("ew"), "Opacus, grad_sample_mode=ew", family="torch"),
    Variant("opacus-functorch", _make_opacus_step("functorch"),
            "Opacus, grad_sample_mode=functorch", family="torch"),
    Variant("opacus-ghost", _make_opacus_step("ghost"), "Opacus, grad_sample_mode=ghost", family="torch"),
]

BASELINE = {"tf": "keras", "torch": "torch"}

# A failure (not a skip) of one of these makes the script exit 1; the others
# (XLA, TF Privacy's jacobian optimizer, Opacus' optional modes) are reported
# in the table but do not fail the run.
REQUIRED = {"keras", "sparta", "tfp-dpmodel", "torch", "opacus-hooks"}

# Warn when other processes took more than this share of the CPUs while timing.
NOISY_PCT = 5.0

# --smoke skips these unless --skip is given explicitly (XLA compilation alone
# takes ~45 s on the 2-core dev machine).
SMOKE_SKIP = ["tfp-dpmodel-xla"]

# Harmless, repeated every step: Opacus' hooks on a model whose input does not
# require grad, and its non-secure RNG notice (fine for timing).
warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="Secure RNG turned off")


# ---------------------------------------------------------------------------
# TF log capture (pfor while_loop fallbacks)
# ---------------------------------------------------------------------------

# pfor's two messages: "Using a while_loop for converting <Op> cause ..." (a
# debug-level record for ops without a converter) and "<Op> uses a while_loop.
# Fix that!" (a warning, e.g. Conv2DBackpropFilter with per-example inputs).
_WHILE_LOOP_RES = (
    re.compile(r"Using a while_loop for converting (\S+)"),
    re.compile(r"(\S+) uses a while_loop"),
)


class _TFLogCapture(logging.Handler):
    """Collects TF python-log records per variant; echoes the other warnings."""

    def __init__(self, echo: bool):
        super().__init__(level=logging.DEBUG)
        self.current = "-"
        self.records: Dict[str, List[str]] = {}
        self.echo = echo

    def emit(self, record):
        try:
            msg = record.getMessage()
        except Exception:  # pragma: no cover
            return
        if "while_loop" in msg or record.levelno >= logging.WARNING:
            self.records.setdefault(self.current, []).append(msg)
        if (self.echo and record.levelno >= logging.INFO) or (
            record.levelno >= logging.WARNING and "while_loop" not in msg
        ):
            sys.stderr.write(f"[tf-log:{self.current}] {msg.splitlines()[0][:300]}\n")

    def while_loop_ops(self, variant: str) -> List[str]:
        ops = []
        for msg in self.records.get(variant, []):
            for pattern in _WHILE_LOOP_RES:
                m = pattern.search(msg)
                if m and m.group(1) not in ops:
                    ops.append(m.group(1))
        return ops


def _install_tf_log_capture(echo: bool) -> _TFLogCapture:
    handler = _TFLogCapture(echo)
    logger = tf.get_logger()
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)  # pfor logs most fallbacks at debug level
    return handler


# ---------------------------------------------------------------------------
# CPU accounting: how much of the machine other processes took while timing
# ---------------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_sample():
    """(machine busy jiffies incl. steal, machine total jiffies, own jiffies)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        own_j = int(own[11]) + int(own[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None
    total = sum(fields)  # user nice system idle iowait irq softirq steal
    busy = total - fields[3] - fields[4]
    return busy, total, own_j


@dataclasses.dataclass
class CpuTally:
    """Accumulates, over a variant's timed blocks, the CPU time of this
    process and of everything else on the machine (other processes and
    hypervisor steal). A shared machine shows up as ``foreign_pct`` > 0."""

    foreign: int = 0
    total: int = 0
    own: int = 0
    wall: float = 0.0

    def add(self, before, after, wall: float) -> None:
        if before is None or after is None:
            return
        d_busy, d_total, d_own = (a - b for a, b in zip(after, before))
        self.foreign += max(0, d_busy - d_own)
        self.total += d_total
        self.own += d_own
        self.wall += wall

    def stats(self) -> dict:
        if not self.total:
            return {}
        return {
            "cpu_jiffies_sampled": self.total,
            "foreign_cpu_pct": 100.0 * self.foreign / self.total,
            "own_cores_busy": (self.own / _CLK_TCK) / self.wall if self.wall else None,
        }


# ---------------------------------------------------------------------------
# Machine description
# ---------------------------------------------------------------------------


def _read(path: str) -> Optional[str]:
    try:
        return pathlib.Path(path).read_text()
    except OSError:
        return None


def _cores() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _read("/sys/fs/cgroup/cpu.max")
    if quota and not quota.startswith("max"):
        q, period = quota.split()[:2]
        n = min(n, max(1, math.floor(int(q) / int(period))))
    return n or 1


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def machine_info(threads: int) -> dict:
    cpuinfo = _read("/proc/cpuinfo") or ""
    models = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    simd = sorted(f for f in (flags.group(1).split() if flags else [])
                  if f in {"avx", "avx2", "fma", "avx512f", "avx512_vnni", "amx_tile"})
    meminfo = _read("/proc/meminfo") or ""
    mem = re.search(r"MemTotal:\s+(\d+) kB", meminfo)
    info = {
        "host": socket.gethostname(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": models[0] if models else platform.processor(),
        "logical_cpus_visible": os.cpu_count(),
        "cores_used": threads,
        "cpu_simd_flags": simd,
        "mem_total_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
        "cgroup_cpu_max": (_read("/sys/fs/cgroup/cpu.max") or "").strip() or None,
        "loadavg_start": (_read("/proc/loadavg") or "").split()[:3],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": _version("keras"),
        "tensorflow_privacy": _version("tensorflow-privacy"),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "opacus": _version("opacus"),
        "tf_gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
        "tf_intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "tf_inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "env": {k: os.environ[k] for k in sorted(os.environ)
                if k in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS", "OMP_NUM_THREADS",
                         "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                         "TF_XLA_FLAGS")},
    }
    return info


# ---------------------------------------------------------------------------
# The harness
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    variant: Variant
    batch_size: int
    status: str = "ok"  # ok | skipped | error
    note: str = ""
    step: Optional[Step] = None
    target: int = 0
    setup_s: float = 0.0
    times: List[float] = dataclasses.field(default_factory=list)
    while_loop_ops: List[str] = dataclasses.field(default_factory=list)
    cpu: CpuTally = dataclasses.field(default_factory=CpuTally)

    def stats(self) -> dict:
        if not self.times:
            return {}
        t = np.asarray(self.times) * 1e3
        q1, med, q3 = np.percentile(t, [25, 50, 75])
        return {
            **self.cpu.stats(),
            "n": int(t.size),
            "median_ms": float(med),
            "q1_ms": float(q1),
            "q3_ms": float(q3),
            "iqr_ms": float(q3 - q1),
            "min_ms": float(t.min()),
            "mean_ms": float(t.mean()),
            "examples_per_s": float(self.batch_size / (med / 1e3)),
        }


def _selected(args) -> List[Variant]:
    def match(name, patterns):
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    out = []
    for v in VARIANTS:
        if args.only and not match(v.name, args.only):
            continue
        if args.skip and match(v.name, args.skip):
            continue
        out.append(v)
    return out


def _fresh_model(seed: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    return resnet20_gn(input_shape=IMAGE_SHAPE, num_classes=NUM_CLASSES)


def bench_batch_size(batch_size: int, args, ctx: Ctx, logcap: _TFLogCapture) -> List[Run]:
    runs: List[Run] = []
    print(f"\n=== batch size {batch_size} ===", flush=True)
    for v in _selected(args):
        run = Run(v, batch_size)
        runs.append(run)
        if v.slow and batch_size > args.slow_max_batch:
            run.status, run.note = "skipped", f"slow variant, batch > --slow-max-batch {args.slow_max_batch}"
            print(f"  {v.name:18s} skipped: {run.note}", flush=True)
            continue
        logcap.current = f"{v.name}@{batch_size}"
        t0 = time.perf_counter()
        try:
            run.step = v.factory(_fresh_model(ctx.seed), batch_size, ctx)
            # Slow variants get the full warm-up too: tfp-vectorized's second
            # call is still ~10x slower than its steady state.
            for _ in range(max(1, args.warmup)):  # >= 1: tracing/compilation is never timed
                loss = run.step()
            if not math.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss}")
        except VariantUnavailable as e:
            run.status, run.note, run.step = "skipped", str(e), None
            print(f"  {v.name:18s} skipped: {e}", flush=True)
            continue
        except Exception as e:
            run.status, run.step = "error", None
            run.note = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(f"  {v.name:18s} ERROR during setup: {run.note}", flush=True)
            if args.verbose:
                traceback.print_exc()
            continue
        finally:
            run.while_loop_ops = logcap.while_loop_ops(logcap.current)
            logcap.current = "-"
        run.setup_s = time.perf_counter() - t0
        run.target = min(args.steps, args.slow_steps) if v.slow else args.steps
        wl = f", while_loop fallbacks: {', '.join(run.while_loop_ops)}" if run.while_loop_ops else ""
        print(f"  {v.name:18s} ready (setup+warmup {run.setup_s:.1f} s{wl})", flush=True)

    active = [r for r in runs if r.status == "ok"]
    for rnd in range(args.rounds):
        if not active:
            break
        order = active[rnd % len(active):] + active[: rnd % len(active)]
        for run in order:
            if run.status != "ok" or len(run.times) >= run.target:
                continue
            per_round = math.ceil(run.target / args.rounds)
            n = min(per_round, run.target - len(run.times))
            try:
                for _ in range(0 if run.variant.slow else args.reentry):
                    run.step()
                before, t_block = _cpu_sample(), time.perf_counter()
                for _ in range(n):
                    t = time.perf_counter()
                    run.step()
                    run.times.append(time.perf_counter() - t)
                run.cpu.add(before, _cpu_sample(), time.perf_counter() - t_block)
            except Exception as e:
                run.status = "error"
                run.note = f"{type(e).__name__} while timing: {str(e).splitlines()[0][:200]}"
                print(f"  {run.variant.name} ERROR: {run.note}", flush=True)
        done = ", ".join(f"{r.variant.name}:{len(r.times)}" for r in active if r.status == "ok")
        print(f"  round {rnd + 1}/{args.rounds} done ({done})", flush=True)
    for run in runs:
        run.step = None  # release models before the next batch size
    tf.keras.backend.clear_session()
    gc.collect()
    return runs


def _results(runs: List[Run]) -> List[dict]:
    out = []
    by_name = {(r.batch_size, r.variant.name): r for r in runs}
    for r in runs:
        d = {
            "batch_size": r.batch_size,
            "variant": r.variant.name,
            "description": r.variant.description,
            "family": r.variant.family,
            "status": r.status,
            "note": r.note,
            "setup_s": round(r.setup_s, 3),
            "while_loop_fallbacks": r.while_loop_ops,
        }
        d.update(r.stats())
        for key, base in (("ratio_vs_keras", "keras"), ("ratio_vs_family_nonprivate", BASELINE[r.variant.family])):
            b = by_name.get((r.batch_size, base))
            if b is not None and b.times and r.times:
                d[key] = d["median_ms"] / b.stats()["median_ms"]
        d["times_ms"] = [round(t * 1e3, 3) for t in r.times]
        out.append(d)
    return out


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def _noted(results: List[dict], batch_size: int, separator: str):
    """``(result, note)`` for each result at ``batch_size``: a failed variant's note, then its
    while_loop fallbacks joined by ``separator``."""
    for d in results:
        if d["batch_size"] != batch_size:
            continue
        note = d["note"] if d["status"] != "ok" else ""
        if d["while_loop_fallbacks"]:
            note = (note + "; " if note else "") + "while_loop: " + separator.join(d["while_loop_fallbacks"])
        yield d, note


def markdown_table(results: List[dict], batch_size: int) -> str:
    rows = [
        "| variant | median ms/step | IQR ms | n | x keras | x same-framework non-private | examples/s "
        "| own cores busy | other CPU % | setup s | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d, note in _noted(results, batch_size, ", "):
        status = "" if d["status"] == "ok" else f"**{d['status']}** "
        rows.append(
            f"| {d['variant']} | {_fmt(d.get('median_ms'), '.1f')} | {_fmt(d.get('iqr_ms'), '.1f')} "
            f"| {d.get('n', 0)} | {_fmt(d.get('ratio_vs_keras'), '.2f')} "
            f"| {_fmt(d.get('ratio_vs_family_nonprivate'), '.2f')} | {_fmt(d.get('examples_per_s'), '.0f')} "
            f"| {_fmt(d.get('own_cores_busy'), '.2f')} | {_fmt(d.get('foreign_cpu_pct'), '.0f')} "
            f"| {_fmt(d.get('setup_s'), '.1f')} | {status}{note} |"
        )
    return "\n".join(rows)


def console_table(results: List[dict], batch_size: int) -> str:
    head = (f"{'variant':18s} {'median ms':>10s} {'IQR ms':>8s} {'n':>3s} {'x keras':>8s} {'x np':>6s} "
            f"{'cores':>5s} {'other%':>6s}  note")
    lines = [head, "-" * len(head)]
    for d, note in _noted(results, batch_size, ","):
        lines.append(
            f"{d['variant']:18s} {_fmt(d.get('median_ms'), '10.1f'):>10s} {_fmt(d.get('iqr_ms'), '8.1f'):>8s} "
            f"{d.get('n', 0):3d} {_fmt(d.get('ratio_vs_keras'), '8.2f'):>8s} "
            f"{_fmt(d.get('ratio_vs_family_nonprivate'), '6.2f'):>6s} {_fmt(d.get('own_cores_busy'), '5.2f'):>5s} "
            f"{_fmt(d.get('foreign_cpu_pct'), '6.0f'):>6s}  {d['status'] if d['status'] != 'ok' else ''} {note}"
        )
    return "\n".join(lines)


def write_markdown(path: pathlib.Path, machine: dict, config: dict, results: List[dict]) -> None:
    m = machine
    lines = [
        "# Step time: ResNet-20-GN, random CIFAR-shaped data",
        "",
        f"- date (UTC): {m['date_utc']}, host `{m['host']}`",
        f"- CPU: {m['cpu_model']}, {m['cores_used']} cores used "
        f"({m['logical_cpus_visible']} logical visible, cgroup cpu.max `{m['cgroup_cpu_max']}`), "
        f"SIMD {' '.join(m['cpu_simd_flags'])}, {m['mem_total_gib']} GiB RAM",
        f"- load average at start: {' '.join(m['loadavg_start'])}; at end: {' '.join(m.get('loadavg_end', []))}",
        f"- TensorFlow {m['tensorflow']}, Keras {m['keras']}, TF Privacy {m['tensorflow_privacy']}, "
        f"torch {m['torch']}, Opacus {m['opacus']}, Python {m['python']}, numpy {m['numpy']}",
        f"- command: `{config['command']}`",
        f"- {config['rounds']} interleaved rounds, {config['steps']} timed steps per variant "
        f"({config['slow_steps']} for slow ones), {config['warmup']} warm-up, {config['reentry']} untimed "
        f"re-entry step(s) per round; SGD(lr {LR}, momentum {MOMENTUM}); DP: clip {CLIP_NORM}, "
        f"noise multiplier {NOISE_MULTIPLIER}, q = B / {config['dataset_size']}",
        "- `x keras`: median / median of the non-private Keras step; `x same-framework non-private`: "
        "torch variants relative to the non-private PyTorch step.",
        "- `own cores busy`: this process's CPU time / wall time during the timed steps; `other CPU %`: "
        "share of all CPU time taken by other processes (and hypervisor steal) meanwhile -- "
        "anything above a few % means a shared, noisy machine (PyTorch's OpenMP threads suffer most).",
        "",
    ]
    for bs in config["batch_sizes"]:
        lines += [f"## Batch size {bs}", "", markdown_table(results, bs), ""]
    wl = sorted({op for d in results for op in d["while_loop_fallbacks"]})
    if wl:
        lines += [
            "TF `vectorized_map` fell back to a `while_loop` (one example at a time) for: "
            + ", ".join(f"`{o}`" for o in wl) + " (see the per-variant notes).",
            "",
        ]
    path.write_text("\n".join(lines))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256], help="physical batch sizes (default 64 256)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per variant after setup (default 3; at least 1 always runs)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--reentry", type=int, default=1, help="untimed steps before each variant's timed block in a round (default 1; 0 for slow variants)")
    p.add_argument("--slow-steps", type=int, default=3, help="timed steps for slow variants (default 3)")
    p.add_argument("--slow-max-batch", type=int, default=64,
                   help="skip slow variants above this batch size (tfp-vectorized is O(B^2) time and memory; default 64)")
    p.add_argument("--skip", nargs="*", default=None, metavar="NAME",
                   help=f"variants to skip (globs); --smoke defaults to {' '.join(SMOKE_SKIP)}, "
                        "give an empty --skip to run them all")
    p.add_argument("--only", nargs="*", default=[], metavar="NAME", help="run only these variants (globs)")
    p.add_argument("--threads", type=int, default=None, help="threads for TF intra-op and torch (default: cores available)")
    p.add_argument("--dataset-size", type=int, default=50_000, help="n for the sampling rate q = B/n (default 50000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="output path stem; writes STEM.json and STEM.md (default benchmarks/results/step_time-<host>; --smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true",
                   help="quick functional check: --batch-sizes 8 --steps 2 --warmup 1 --rounds 2 --slow-steps 1")
    p.add_argument("--list", action="store_true", help="list the variants and exit")
    p.add_argument("--tf-log", action="store_true", help="echo every TF python-log line (default: only warnings, without pfor while_loop notices)")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing variants")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.steps, args.warmup, args.rounds, args.slow_steps = [8], 2, 1, 2, 1
        if args.skip is None:
            args.skip = list(SMOKE_SKIP)
    args.skip = args.skip or []
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.rounds < 1:
        p.error("batch sizes, --steps and --rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for v in VARIANTS:
            print(f"{v.name:18s} {v.description}{'  [slow]' if v.slow else ''}")
        return 0

    threads = args.threads or _cores()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    try:
        import torch

        torch.set_num_threads(threads)
    except Exception:
        pass
    logcap = _install_tf_log_capture(args.tf_log)
    ctx = Ctx(dataset_size=args.dataset_size, threads=threads, seed=args.seed)
    machine = machine_info(threads)
    print(f"{machine['cpu_model']} | {threads} threads | TF {machine['tensorflow']} | "
          f"torch {machine['torch']} | opacus {machine['opacus']} | load {' '.join(machine['loadavg_start'])}",
          flush=True)

    t_start = time.perf_counter()
    runs: List[Run] = []
    for bs in args.batch_sizes:
        runs += bench_batch_size(bs, args, ctx, logcap)
    machine["loadavg_end"] = (_read("/proc/loadavg") or "").split()[:3]
    machine["wall_s"] = round(time.perf_counter() - t_start, 1)
    results = _results(runs)

    for bs in args.batch_sizes:
        print(f"\nbatch size {bs}  (x np = ratio to the same framework's non-private step)")
        print(console_table(results, bs))

    if args.out:
        stem = pathlib.Path(args.out)
        if stem.suffix in (".json", ".md"):
            stem = stem.with_suffix("")
    elif args.smoke:
        stem = pathlib.Path(tempfile.mkdtemp(prefix="step_time_smoke_")) / "step_time-smoke"
    else:
        stem = HERE / "results" / f"step_time-{socket.gethostname()}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("list",)}
    config["threads"] = threads
    config["command"] = " ".join([pathlib.Path(sys.argv[0]).name] + sys.argv[1:]) if argv is None else " ".join(argv)
    payload = {"machine": machine, "config": config, "results": results}
    json_path, md_path = stem.parent / (stem.name + ".json"), stem.parent / (stem.name + ".md")
    json_path.write_text(json.dumps(payload, indent=1))
    write_markdown(md_path, machine, config, results)
    print(f"\nwrote {json_path} and {md_path} ({machine['wall_s']} s)")

    # /proc/stat counts in jiffies (10 ms): judge only variants sampled long enough.
    noisy = [d for d in results
             if d.get("foreign_cpu_pct", 0) > NOISY_PCT and d.get("cpu_jiffies_sampled", 0) >= 200]
    if noisy:
        worst = max(d["foreign_cpu_pct"] for d in noisy)
        print(f"WARNING: other processes used up to {worst:.0f}% of the CPUs while timing "
              f"({', '.join(sorted({d['variant'] for d in noisy}))}): numbers are not clean.")
    errors = [r for r in runs if r.status == "error"]
    bad = [r for r in errors if r.variant.name in REQUIRED]
    if errors:
        print("errors: " + "; ".join(f"{r.variant.name}@{r.batch_size}: {r.note}" for r in errors))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
