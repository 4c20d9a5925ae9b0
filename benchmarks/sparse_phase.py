#!/usr/bin/env python
"""Cost of SPARTA's phases next to a full DP-SGD step: step time and peak memory.

For each (model, batch size) configuration the same network and the same
random CIFAR-shaped batch pool (32x32x3, 10 classes) are run through:

  keras             non-private Keras step (reference only)
  dp-full           full DP-SGD step, every parameter (``sparta_tf.DPModel``,
                    default engine: book-keeping) -- THE REFERENCE of every ratio here
  selection         SPARTA selection-epoch step: private row scores of every
                    kernel (``DPModel.begin_scoring``), no weight update
  sparse-20         SPARTA sparse phase, 20% of the rows of every kernel +
                    biases/norms/head
  sparse-1          the same at 1% of the rows (at least one row per layer)
  dp-bitfit         DP-BitFit = SPARTA's warm-up set (``methods.warmup_set``:
                    biases/norms/head, no kernel rows)
  input-grad-floor  forward + backward to the network INPUT only, no weight
                    gradients, no update (``tape.gradient(loss, x)``): a lower
                    bound for any DP step that trains something in the first
                    layer, since it needs the output gradient of that layer

The sparse-phase rows are a seeded uniformly random subset per layer
(``random_selections(row_groups(model), density, "row", seed)``), which costs
exactly what a privately *selected* mask of the same density costs: the
per-example gradient work depends only on how many rows each layer trains,
not on which.

Timing reuses ``benchmarks/step_time.py`` (same fit-path ``tf.function``,
same SGD and DP settings, same interleaved rounds: every variant of a
configuration built and warmed up in one process, then ``--rounds`` rounds in
rotated order with an untimed re-entry step per block). We report the median
and IQR of per-step times and the ratio of medians to ``dp-full``, plus the
range of the per-round ratios (each round's median over ``dp-full``'s median
in the same round): a ratio whose range is narrow is robust to the machine
noise that moves both.

Peak memory: every (configuration, variant) runs in a FRESH subprocess
(``--memory-child``) that builds the model and the step, measures its
resident set size just before the first step (``rss_before``), runs
``--mem-steps`` steps and reports

* ``growth``: the peak RSS over all steps minus ``rss_before`` -- what the
  step (including its one-off tracing) adds to the process's peak;
* ``steady growth``: the peak RSS over steps 2..N only (the kernel's
  high-water mark is reset with ``/proc/self/clear_refs`` after step 1, so
  graph tracing is excluded) minus ``rss_before``; missing where
  ``clear_refs`` is not writable;
* ``peak``: the absolute peak RSS of the process (TF runtime and model
  included).

Peak RSS is the kernel's high-water mark ``VmHWM`` (``/proc/self/status``),
not ``getrusage(...).ru_maxrss``: a process started by ``subprocess`` inherits
its parent's RSS at spawn time into ``ru_maxrss`` (Linux folds the pre-``exec``
address space's high-water mark into it), so every child of a large parent
would report the parent's size. ``ru_maxrss`` is still recorded in the JSON.

plus the analytic size of the per-example gradients the step materialises,
``B x (coordinates needing a per-example gradient) x 4 bytes``.

Targets (from the issue), printed next to the measured ratios:
``sparse-20 <= 0.6 x dp-full``, ``sparse-1 <= 0.4 x dp-full``,
``selection <= 1.2 x dp-full``.

Examples::

    python benchmarks/sparse_phase.py --smoke              # CI: ResNet-20, B=8, 2 steps, 1 round (~75 s)
    python benchmarks/sparse_phase.py                      # full run (~16 min on 2 cores)
    python benchmarks/sparse_phase.py --configs resnet20_gn:64 --no-memory
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import step_time as st  # noqa: E402  (puts the repo root on sys.path too)
import tensorflow as tf  # noqa: E402

from sparta_tf import methods  # noqa: E402
from sparta_tf.models import resnet18_gn, resnet20_gn, vit_tiny  # noqa: E402


def dense_mlp(input_shape, num_classes: int, width: int = 1024, depth: int = 3) -> tf.keras.Model:
    """The Dense-only MLP of the engine issue: flatten(3072) -> width x depth (ReLU) -> classes
    (3072-1024-1024-1024-10: 5.3M parameters); ReLU is a separate layer so Dense stays linear."""
    layers = [tf.keras.Input(input_shape), tf.keras.layers.Flatten()]
    for _ in range(depth):
        layers += [tf.keras.layers.Dense(width), tf.keras.layers.ReLU()]
    return tf.keras.Sequential(layers + [tf.keras.layers.Dense(num_classes)], name="dense_mlp")


MODELS = {"resnet20_gn": resnet20_gn, "resnet18_gn": resnet18_gn, "vit_tiny": vit_tiny, "mlp": dense_mlp}
DEFAULT_CONFIGS = ["resnet20_gn:256", "vit_tiny:256"]
DEFAULT_STEPS = {"resnet20_gn": 20, "resnet18_gn": 10, "vit_tiny": 6, "mlp": 10}  # timed steps per variant
REFERENCE = "dp-full"
XLA_SUFFIX = "+xla"
# variant -> the largest acceptable ratio of its median to dp-full's (from the issue)
TARGETS: Dict[str, float] = {"sparse-20": 0.6, "sparse-1": 0.4, "selection": 1.2}
SMOKE_MEMORY_VARIANTS = ["sparse-1"]


# ---------------------------------------------------------------------------
# The two variants step_time.py does not have
# ---------------------------------------------------------------------------


def make_dp_bitfit_step(model: tf.keras.Model, batch_size: int, ctx: st.Ctx) -> st.Step:
    """DP-SGD on SPARTA's warm-up set (biases + norms + head) = DP-BitFit."""

    def configure(dp_model):
        dp_model.set_trainable_set(methods.warmup_set(model))

    return st._sparta_step(model, batch_size, ctx, engine="auto", configure=configure)


class _InputGradFloor(tf.keras.Model):
    """Train step = forward + gradient of the batch loss w.r.t. the input only."""

    def __init__(self, model: tf.keras.Model):
        super().__init__(name="input_grad_floor")
        self.model = model

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def train_step(self, data):
        x, y, _ = tf.keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(x)
            loss = self.compiled_loss(y, self.model(x, training=True))
        dx = tape.gradient(loss, x)
        # Returned as a value: with only a control dependency on it, the backward pass was
        # pruned from the step (which then timed as a forward pass).
        return {"loss": loss, "zz_input_grad_sum": tf.reduce_sum(dx)}


def make_input_grad_floor_step(model: tf.keras.Model, batch_size: int, ctx: st.Ctx) -> st.Step:
    floor = _InputGradFloor(model)
    floor.compile(optimizer=st._sgd(), loss=st._xent(), jit_compile=ctx.jit_compile)
    return st._fit_path_step(floor, st._tf_dataset(batch_size, ctx.seed))


def make_layerwise_dp_step(model: tf.keras.Model, batch_size: int, ctx: st.Ctx) -> st.Step:
    """The previous default: per-example gradients materialised layer by layer, then clipped."""
    return st._sparta_step(model, batch_size, ctx, engine="layerwise")


def make_tfp_ghost_step(model: tf.keras.Model, batch_size: int, ctx: st.Ctx) -> st.Step:
    """TF Privacy's DPModel with its default layer registry (ghost clipping of Dense and Embedding;
    every other layer is outside the registry, which TF Privacy refuses)."""
    st.require_tf_privacy()
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
    from tensorflow_privacy.privacy.keras_models.dp_keras_model import make_dp_model_class

    unsupported = sorted({type(l).__name__ for l in model.layers if l.trainable_weights}
                         - {"Dense", "Embedding"})
    if unsupported:
        raise st.VariantUnavailable(f"TF Privacy's registry has no rule for {', '.join(unsupported)}")
    dp_model = make_dp_model_class(tf.keras.Model)(
        l2_norm_clip=st.CLIP_NORM, noise_multiplier=st.NOISE_MULTIPLIER, num_microbatches=None,
        layer_registry=layer_registry.make_default_layer_registry(), inputs=model.inputs, outputs=model.outputs)
    dp_model.compile(optimizer=st._sgd(), loss=st._xent())
    return st._fit_path_step(dp_model, st._tf_dataset(batch_size, ctx.seed))


class _NoiseFloor(tf.keras.Model):
    """Train step = only the DP-SGD noise: one N(0, sigma^2 C^2) draw per trainable coordinate
    (``sparta_tf.dp_step.noise.gaussian_noise``, stateless Philox as in the DP step), applied by the optimizer."""

    def __init__(self, model: tf.keras.Model):
        super().__init__(name="noise_floor")
        self.model = model
        self.step_counter = tf.Variable(0, dtype=tf.int64, trainable=False)

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def train_step(self, data):
        from sparta_tf.dp_step.noise import gaussian_noise

        variables = self.model.trainable_variables
        noise = gaussian_noise([v.shape for v in variables], st.NOISE_MULTIPLIER * st.CLIP_NORM,
                               tf.constant(0, tf.int64), self.step_counter)
        self.optimizer.apply_gradients(zip(noise, variables))
        self.step_counter.assign_add(1)
        return {"loss": tf.constant(0.0)}


def make_noise_floor_step(model: tf.keras.Model, batch_size: int, ctx: st.Ctx) -> st.Step:
    floor = _NoiseFloor(model)
    floor.compile(optimizer=st._sgd(), loss=st._xent(), jit_compile=ctx.jit_compile)
    return st._fit_path_step(floor, st._tf_dataset(batch_size, ctx.seed))


VARIANTS: List[st.Variant] = [
    st.Variant("keras", st.make_keras_step, "Keras non-private step (reference only)"),
    st.Variant(REFERENCE, st.make_sparta_dp_step, "full DP-SGD step, all parameters (DPModel, default engine: book-keeping)"),
    st.Variant("dp-layerwise", make_layerwise_dp_step, "full DP-SGD step with the previous default, engine='layerwise' (materialised)"),
    st.Variant("selection", st.make_sparta_selection_step, "SPARTA selection-epoch step: row scores of all kernels, no update"),
    st.Variant("sparse-20", st._make_sparta_sparse_step(0.20), "SPARTA sparse phase, 20% of rows per kernel + biases/norms/head"),
    st.Variant("sparse-1", st._make_sparta_sparse_step(0.01), "SPARTA sparse phase, 1% of rows per kernel + biases/norms/head"),
    st.Variant("dp-bitfit", make_dp_bitfit_step, "DP-BitFit = SPARTA warm-up set (biases/norms/head)"),
    st.Variant("input-grad-floor", make_input_grad_floor_step, "forward + backward to the input only (no weight grads)"),
    st.Variant("noise-floor", make_noise_floor_step, "only the DP noise of every trainable coordinate + the optimizer (no forward/backward)"),
    st.Variant("tfp-dpmodel", st._make_tfp_dpmodel_step(False),
               "TF Privacy make_dp_model_class (vectorized_map per-example grads), use_xla=False"),
    st.Variant("tfp-ghost", make_tfp_ghost_step, "TF Privacy DPModel + default layer_registry (ghost clipping)"),
    st.Variant("tfp-vectorized", st.make_tfp_vectorized_step,
               "TF Privacy VectorizedDPKerasSGDOptimizer, B microbatches (tape.jacobian: O(B^2))", slow=True),
]
# The TF Privacy steps are not ours to put under XLA; the rest get an XLA twin with --xla both.
XLA_TWINNED = ["keras", REFERENCE, "selection", "sparse-20", "sparse-1", "dp-bitfit"]


def xla_twin(variant: st.Variant) -> st.Variant:
    """The same step compiled with ``jit_compile=True`` (named ``<name>+xla``)."""

    def factory(model: tf.keras.Model, batch_size: int, ctx: st.Ctx) -> st.Step:
        return variant.factory(model, batch_size, dataclasses.replace(ctx, jit_compile=True))

    return st.Variant(variant.name + XLA_SUFFIX, factory, variant.description + ", XLA (jit_compile=True)",
                      slow=variant.slow)


DEFAULT_XLA_VARIANTS = ["keras", REFERENCE, "sparse-20"]
ALL_VARIANTS = VARIANTS + [xla_twin(v) for v in VARIANTS if v.name in XLA_TWINNED]
VARIANT_BY_NAME = {v.name: v for v in ALL_VARIANTS}


def base_name(variant: str) -> str:
    """``dp-full+xla`` -> ``dp-full``."""
    return variant[: -len(XLA_SUFFIX)] if variant.endswith(XLA_SUFFIX) else variant


def reference_for(variant: str) -> str:
    """The full DP step of the same compilation mode: the reference of the variant's ratio."""
    return REFERENCE + XLA_SUFFIX if variant.endswith(XLA_SUFFIX) else REFERENCE


def per_example_coordinates(model: tf.keras.Model, variant: str, seed: int) -> Optional[int]:
    """How many coordinates the step materialises per-example gradients of, all at once (None:
    none; the book-keeping variants compute norms and clipped sums without them, at most one
    layer's per-example gradients at a time where the cost model picks the direct norm)."""
    if base_name(variant) in ("dp-layerwise", "tfp-dpmodel", "tfp-vectorized"):
        return int(sum(np.prod(v.shape.as_list()) for v in model.trainable_variables))
    return None


def parse_config(text: str) -> Tuple[str, int]:
    name, _, batch = text.partition(":")
    if name not in MODELS or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODEL:BATCH with MODEL in {sorted(MODELS)}")
    return name, int(batch)


def fresh_model(name: str, seed: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    return MODELS[name](input_shape=st.IMAGE_SHAPE, num_classes=st.NUM_CLASSES)


# ---------------------------------------------------------------------------
# Timing: step_time's interleaved harness on this variant list and model
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _harness_for(model_name: str, variants: List[st.Variant]):
    """Points step_time.bench_batch_size at our variants and model (restored on exit)."""
    saved = st.VARIANTS, st._fresh_model
    st.VARIANTS = variants
    st._fresh_model = lambda seed: fresh_model(model_name, seed)
    try:
        yield
    finally:
        st.VARIANTS, st._fresh_model = saved


def _round_medians(run: st.Run, rounds: int) -> List[float]:
    """Median step time (s) of each round's block (bench_batch_size fills them in order)."""
    per_round = math.ceil(run.target / rounds) if run.target else 0
    if not per_round:
        return []
    return [float(np.median(run.times[i:i + per_round])) for i in range(0, len(run.times), per_round)]


def time_config(model_name: str, batch_size: int, args, ctx: st.Ctx, logcap) -> List[dict]:
    variants = [VARIANT_BY_NAME[n] for n in args.variants]
    if args.xla == "both":
        variants += [VARIANT_BY_NAME[n + XLA_SUFFIX] for n in args.xla_variants if n in args.variants]
    print(f"\n##### {model_name}, batch {batch_size}", flush=True)
    with _harness_for(model_name, variants):
        runs = st.bench_batch_size(batch_size, args, ctx, logcap)
    results = st._results(runs)
    refs = {r.variant.name: r for r in runs if r.variant.name.startswith(REFERENCE) and r.times}
    for run, d in zip(runs, results):
        d["model"] = model_name
        d.pop("ratio_vs_family_nonprivate", None)
        ref = refs.get(REFERENCE)
        if ref is not None and run.times:
            d["ratio_vs_dp_full"] = d["median_ms"] / ref.stats()["median_ms"]
            paired = [a / b for a, b in zip(_round_medians(run, args.rounds), _round_medians(ref, args.rounds))]
            d["round_ratios_vs_dp_full"] = [round(p, 4) for p in paired]
        same_mode = refs.get(reference_for(d["variant"]))
        if same_mode is not None and run.times:
            d["ratio_vs_dp_full_same_mode"] = d["median_ms"] / same_mode.stats()["median_ms"]
        target = TARGETS.get(base_name(d["variant"]))
        if target is not None:
            d["target_ratio_max"] = target
            d["target_met"] = bool(d.get("ratio_vs_dp_full_same_mode", math.inf) <= target) if run.times else None
    return results


# ---------------------------------------------------------------------------
# Peak memory: one fresh subprocess per (configuration, variant)
# ---------------------------------------------------------------------------

_MIB = 2**20


def _status_kib(field: str) -> Optional[int]:
    text = st._read("/proc/self/status") or ""
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def _peak_kib() -> int:
    """This process's peak RSS (KiB): the kernel's high-water mark ``VmHWM`` of its address space.

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: at ``exec`` Linux carries the old address
    space's high-water mark -- the parent's, for a child of ``subprocess`` -- into
    ``ru_maxrss``, so a child of a 6 GiB benchmark process reports >= 6 GiB whatever it
    does. ``VmHWM`` belongs to the fresh address space only. ``ru_maxrss`` where
    ``/proc`` is missing.
    """
    hwm = _status_kib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak_rss() -> bool:
    """Resets the kernel's RSS high-water mark (VmHWM) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_child(args) -> int:
    """Builds one variant in this (fresh) process, runs it, prints one JSON line."""
    threads = args.threads or st._cores()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    model_name, batch_size = args.config
    ctx = st.Ctx(dataset_size=args.dataset_size, threads=threads, seed=args.seed)
    model = fresh_model(model_name, ctx.seed)
    coords = per_example_coordinates(model, args.memory_child, ctx.seed)
    step = VARIANT_BY_NAME[args.memory_child].factory(model, batch_size, ctx)
    gc.collect()
    hwm_build_kib = _peak_kib()
    rss_before_kib = _status_kib("VmRSS")
    t0 = time.perf_counter()
    loss = step()  # traces, then runs
    first_s = time.perf_counter() - t0
    hwm_first_kib = _peak_kib()
    reset = args.mem_steps > 1 and _reset_peak_rss()
    for _ in range(args.mem_steps - 1):
        loss = step()
    hwm_steady_kib = _peak_kib() if reset else None
    peak_kib = max(hwm_first_kib, hwm_steady_kib or 0)  # the reset dropped the tracing peak
    out = {
        "model": model_name,
        "batch_size": batch_size,
        "variant": args.memory_child,
        "steps": args.mem_steps,
        "loss_finite": bool(math.isfinite(loss)),
        "first_step_s": round(first_s, 2),
        "rss_before_mib": rss_before_kib / 1024,
        "peak_after_build_mib": hwm_build_kib / 1024,
        "peak_mib": peak_kib / 1024,
        "growth_mib": (peak_kib - rss_before_kib) / 1024,
        "steady_growth_mib": (hwm_steady_kib - rss_before_kib) / 1024 if hwm_steady_kib else None,
        # Not used: after fork+exec Linux folds the PARENT's RSS at spawn time into the
        # child's ru_maxrss (see _peak_kib), so it is >= the benchmark process's size.
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "per_example_coords": coords,
        "per_example_grads_mib": coords * batch_size * 4 / _MIB if coords is not None else None,
    }
    print("MEMORY-RESULT " + json.dumps(out), flush=True)
    return 0


def measure_memory(configs, args) -> List[dict]:
    results = []
    variants = list(args.memory_variants or args.variants)  # XLA twins only when named here
    for model_name, batch_size in configs:
        for name in variants:
            if VARIANT_BY_NAME[name].slow and batch_size > args.slow_max_batch:
                results.append({"model": model_name, "batch_size": batch_size, "variant": name, "status": "skipped",
                                "note": f"slow variant, batch > --slow-max-batch {args.slow_max_batch}"})
                continue
            cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--memory-child", name,
                   "--config", f"{model_name}:{batch_size}", "--mem-steps", str(args.mem_steps),
                   "--dataset-size", str(args.dataset_size), "--seed", str(args.seed)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY-RESULT ")), None)
            if proc.returncode == 0 and line:
                d = json.loads(line.split(" ", 1)[1])
                d["status"] = "ok"
            else:
                tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
                d = {"model": model_name, "batch_size": batch_size, "variant": name,
                     "status": "error", "note": f"exit {proc.returncode}: {tail}"}
            d["wall_s"] = round(time.perf_counter() - t0, 1)
            results.append(d)
            print(f"  memory {model_name}:{batch_size} {name:17s} "
                  + (f"growth {d['growth_mib']:7.0f} MiB, steady {_fmt(d['steady_growth_mib'], '7.0f')} MiB, "
                     f"peak {d['peak_mib']:6.0f} MiB ({d['wall_s']} s)" if d["status"] == "ok" else d["note"]),
                  flush=True)
    return results


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def _verdict(d: dict) -> str:
    if "target_ratio_max" not in d:
        return ""
    met = d.get("target_met")
    return f"<= {d['target_ratio_max']:.1f}: " + ("PASS" if met else "FAIL" if met is False else "n/a")


def _steps_per_s(d: dict) -> Optional[float]:
    return 1000.0 / d["median_ms"] if d.get("median_ms") else None


def _round_range(d: dict) -> str:
    r = d.get("round_ratios_vs_dp_full") or []
    return f"{min(r):.2f}-{max(r):.2f}" if r else "-"


def markdown_table(timing: List[dict], memory: List[dict], model: str, batch_size: int) -> str:
    mem = {m["variant"]: m for m in memory if m["model"] == model and m["batch_size"] == batch_size}
    rows = [
        "| variant | median ms/step | steps/s | IQR ms | n | x dp-full | per-round x dp-full | x dp-full same XLA mode "
        "| target | x keras | per-ex. grads MiB | mem growth MiB | steady growth MiB | peak RSS MiB | other CPU % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for d in timing:
        if d["model"] != model or d["batch_size"] != batch_size:
            continue
        m = mem.get(d["variant"], {})
        status = "" if d["status"] == "ok" else f" **{d['status']}** {d['note']}"
        mem_note = "" if not m or m.get("status") == "ok" else f" (memory: {m.get('note')})"
        rows.append(
            f"| {d['variant']}{status}{mem_note} | {_fmt(d.get('median_ms'), '.1f')} | {_fmt(_steps_per_s(d), '.2f')} "
            f"| {_fmt(d.get('iqr_ms'), '.1f')} | {d.get('n', 0)} | {_fmt(d.get('ratio_vs_dp_full'), '.2f')} "
            f"| {_round_range(d)} | {_fmt(d.get('ratio_vs_dp_full_same_mode'), '.2f')} | {_verdict(d)} "
            f"| {_fmt(d.get('ratio_vs_keras'), '.2f')} | {_fmt(m.get('per_example_grads_mib'), '.1f')} "
            f"| {_fmt(m.get('growth_mib'), '.0f')} | {_fmt(m.get('steady_growth_mib'), '.0f')} "
            f"| {_fmt(m.get('peak_mib'), '.0f')} | {_fmt(d.get('foreign_cpu_pct'), '.0f')} |"
        )
    return "\n".join(rows)


def console_table(timing: List[dict], memory: List[dict], model: str, batch_size: int) -> str:
    mem = {m["variant"]: m for m in memory if m["model"] == model and m["batch_size"] == batch_size}
    head = (f"{'variant':17s} {'median ms':>10s} {'IQR':>7s} {'x dp-full':>9s} {'rounds':>10s} "
            f"{'x keras':>7s} {'growth MiB':>10s} {'steady':>7s} {'peak':>6s}  target")
    lines = [head, "-" * len(head)]
    for d in timing:
        if d["model"] != model or d["batch_size"] != batch_size:
            continue
        m = mem.get(d["variant"], {})
        lines.append(
            f"{d['variant']:17s} {_fmt(d.get('median_ms'), '10.1f'):>10s} {_fmt(d.get('iqr_ms'), '7.1f'):>7s} "
            f"{_fmt(d.get('ratio_vs_dp_full'), '9.2f'):>9s} {_round_range(d):>10s} "
            f"{_fmt(d.get('ratio_vs_keras'), '7.2f'):>7s} {_fmt(m.get('growth_mib'), '10.0f'):>10s} "
            f"{_fmt(m.get('steady_growth_mib'), '7.0f'):>7s} {_fmt(m.get('peak_mib'), '6.0f'):>6s}  "
            f"{_verdict(d)}{'' if d['status'] == 'ok' else ' ' + d['status'] + ': ' + d['note']}"
        )
    return "\n".join(lines)


def _floor_notes(timing: List[dict], configs) -> List[str]:
    """Why a target is missed: the measured floor next to the sparse phase, per configuration."""
    notes = []
    for model, bs in configs:
        by = {d["variant"]: d for d in timing if d["model"] == model and d["batch_size"] == bs}
        floor, keras = by.get("input-grad-floor", {}), by.get("keras", {})
        parts = []
        if "ratio_vs_dp_full" in floor:
            parts.append(f"input-grad floor = {floor['ratio_vs_dp_full']:.2f}x dp-full")
        if "ratio_vs_dp_full" in keras:
            parts.append(f"non-private Keras step = {keras['ratio_vs_dp_full']:.2f}x")
        for name in ("dp-bitfit", "sparse-1", "sparse-20", "selection"):
            if "ratio_vs_dp_full" in by.get(name, {}):
                parts.append(f"{name} = {by[name]['ratio_vs_dp_full']:.2f}x")
        if parts:
            notes.append(f"- {model}, B = {bs}: " + ", ".join(parts))
        f = floor.get("ratio_vs_dp_full")
        bitfit = by.get("dp-bitfit", {}).get("ratio_vs_dp_full")
        for name, target in TARGETS.items():
            d = by.get(name, {})
            if d.get("target_met") is not False or f is None:
                continue
            r = d["ratio_vs_dp_full"]
            if f >= target:
                why = (f"the floor alone is {f:.2f}x >= {target}x, so no DP step that needs the "
                       "first layer's output gradient can meet it with this backward pass")
            else:
                why = f"the floor is {f:.2f}x"
                if bitfit is not None:
                    why += f", DP-BitFit (no kernel rows at all) is {bitfit:.2f}x" + (
                        " -- already above the target" if bitfit > target else "")
            if name.startswith("sparse-") and f < 1:
                why += (f"; above the floor it costs {(r - f) / (1 - f):.0%} of the full step's "
                        f"per-example work ({r - f:.2f}x of {1 - f:.2f}x) for {name.split('-')[1]}% of the rows")
            notes.append(f"  - {name} misses {target}x ({r:.2f}x): {why}.")
    return notes


def write_markdown(path: pathlib.Path, payload: dict) -> None:
    m, config, timing, memory = payload["machine"], payload["config"], payload["timing"], payload["memory"]
    configs = [tuple(c) for c in config["configs"]]
    lines = [
        "# SPARTA phases vs the full DP-SGD step: step time and peak memory",
        "",
        f"- date (UTC): {m['date_utc']}, host `{m['host']}`, git `{m.get('git_head', '?')}`"
        + (f" + uncommitted changes in {', '.join(m['git_dirty'])}" if m.get("git_dirty") else ""),
        f"- CPU: {m['cpu_model']}, {m['cores_used']} cores used ({m['logical_cpus_visible']} logical visible), "
        f"SIMD {' '.join(m['cpu_simd_flags'])}, {m['mem_total_gib']} GiB RAM",
        f"- load average at start: {' '.join(m['loadavg_start'])}; at end: {' '.join(m.get('loadavg_end', []))}",
        *([f"- **the git state changed during the run**, at the end: `{m['git_changed_during_run']}`"]
          if m.get("git_changed_during_run") else []),
        f"- TensorFlow {m['tensorflow']}, Keras {m['keras']}, Python {m['python']}, numpy {m['numpy']}",
        f"- command: `{config['command']}` ({m.get('wall_s', '?')} s)",
        *([f"- timing taken from an earlier run: `{m['timing_run']['command']}` at "
           f"{m['timing_run']['date_utc']} ({m['timing_run']['wall_s']} s, load average "
           f"{' '.join(m['timing_run']['loadavg_start'] or [])} -> {' '.join(m['timing_run']['loadavg_end'] or [])}, "
           f"git `{m['timing_run']['git_head']}`"
           + (f" + uncommitted changes in {', '.join(m['timing_run']['git_dirty'])}" if m['timing_run']['git_dirty'] else "")
           + ")"]
          if m.get("timing_run") else []),
        f"- timing: {config['rounds']} interleaved rounds, {config['steps']} timed steps per variant, "
        f"{config['warmup']} warm-up, {config['reentry']} untimed re-entry step(s) per round "
        f"(harness of `step_time.py`); SGD(lr {st.LR}, momentum {st.MOMENTUM}); DP: clip {st.CLIP_NORM}, "
        f"noise multiplier {st.NOISE_MULTIPLIER}, q = B / {config['dataset_size']}",
        f"- memory: one fresh process per cell, {config['mem_steps']} steps; `mem growth` = peak RSS "
        "(`VmHWM`; not `ru_maxrss`, which a child inherits from its parent) minus RSS just before the first step (includes the one-off graph tracing); "
        "`steady growth` = peak RSS over steps 2..N (high-water mark reset via `/proc/self/clear_refs` "
        "after step 1) minus the same baseline; `peak RSS` = absolute; `per-ex. grads` = "
        "B x coordinates with per-example gradients x 4 bytes (analytic)",
        "- `x dp-full`: ratio of medians to the full DP-SGD step; `per-round`: range over rounds of "
        "(the variant's median in the round / dp-full's median in the same round). `other CPU %`: "
        "share of the machine's CPU used by other processes while timing (noise).",
        "- sparse-phase rows are seeded random rows per layer: the same cost as a selected mask "
        "of the same density (the cost depends on the number of rows per layer, not on which).",
        "",
    ]
    for model, bs in configs:
        lines += [f"## {model}, batch size {bs}", "", markdown_table(timing, memory, model, bs), ""]
    verdicts = [d for d in timing if "target_ratio_max" in d]
    if verdicts:
        lines += ["## Targets", ""]
        for d in verdicts:
            lines.append(f"- {d['model']} B = {d['batch_size']}, {d['variant']}: "
                         f"{_fmt(d.get('ratio_vs_dp_full'), '.2f')}x dp-full, target {_verdict(d)}")
        lines.append("")
    notes = _floor_notes(timing, configs)
    if notes:
        lines += [
            "## The floor",
            "",
            "Every DP step here that trains a row of the first layer (the sparse phase, the selection "
            "step, DP-BitFit through the first GroupNorm) needs the output gradient of that layer, i.e. "
            "a forward pass plus a backward pass through (almost) the whole network to the layer "
            "inputs. `input-grad-floor` measures exactly that (forward + `tape.gradient(loss, x)`, "
            "no weight gradients, no optimizer; grappler prunes the unused `Conv2DBackpropFilter` "
            "ops): no sparse phase can be cheaper than it, whatever its density.",
            "",
            *notes,
            "",
            "Above the floor, the work of a sparse step does not shrink in proportion to its rows: "
            "the per-example kernel gradient of k rows of a convolution (`Conv2DRule._kernel_grads`) "
            "multiplies the output gradient of the k rows with per-example copies of the whole layer "
            "input, one per kernel tap (im2col patches, or strided views for large outputs); building "
            "those copies costs the same whatever k is, only the matmul shrinks with k (for k <= "
            "`DEPTHWISE_MAX_ROWS` a depthwise correlation per row is used instead). The `steady "
            "growth` column, far above `per-ex. grads` for the sparse steps, is consistent with these "
            "copies dominating. Biases, GroupNorm and head (the DP-BitFit part, trained in every "
            "sparse step) add their own per-example work, clipping and noise on top of the floor.",
            "",
        ]
    path.write_text("\n".join(lines) + "\n")


def _git_state() -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=HERE.parent, capture_output=True, text=True, timeout=10).stdout
        except Exception:
            return ""

    head = git("rev-parse", "--short", "HEAD").strip() or None
    dirty = [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no").splitlines() if ln.strip()]
    return {"git_head": head, "git_dirty": dirty}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=parse_config, nargs="+", default=None, metavar="MODEL:BATCH",
                   help=f"configurations (default {' '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS], choices=[v.name for v in VARIANTS],
                   help="variants to time (default: all; dp-full is needed for the ratios)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default: 20 ResNet-20, 10 ResNet-18, 6 ViT)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps after setup (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--reentry", type=int, default=1, help="untimed steps before each timed block (default 1)")
    p.add_argument("--xla", choices=("off", "both"), default="off",
                   help="both: also time an XLA (jit_compile=True) twin of each of --xla-variants")
    p.add_argument("--xla-variants", nargs="+", default=DEFAULT_XLA_VARIANTS, choices=XLA_TWINNED,
                   help="the variants that get an XLA twin with --xla both (default: "
                        f"{' '.join(DEFAULT_XLA_VARIANTS)}; XLA compilation of one DP step takes minutes on a CPU)")
    p.add_argument("--slow-max-batch", type=int, default=64,
                   help="skip slow variants (tfp-vectorized: O(B^2) jacobian) above this batch (default 64)")
    p.add_argument("--slow-steps", type=int, default=3, help="timed steps (in all) of slow variants (default 3)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--timing-from", default=None, metavar="JSON",
                   help="take the timing of the --configs cells from an earlier run's JSON and only "
                        "measure memory (the report says so)")
    p.add_argument("--memory-variants", nargs="+", default=None, choices=list(VARIANT_BY_NAME),
                   help="variants whose peak memory is measured (default: --variants; --smoke: "
                        f"{' '.join(SMOKE_MEMORY_VARIANTS)})")
    p.add_argument("--mem-steps", type=int, default=4, help="steps per memory subprocess (default 4: 1 tracing + 3)")
    p.add_argument("--threads", type=int, default=None, help="TF intra-op threads (default: cores available)")
    p.add_argument("--dataset-size", type=int, default=50_000, help="n for q = B/n (default 50000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="JSON output path; the .md goes next to it (default "
                        "benchmarks/results/sparse_phase-<host>.json; --smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true",
                   help="functional check in seconds: --configs resnet20_gn:8 --steps 2 --warmup 1 --rounds 1, "
                        f"memory of {' '.join(SMOKE_MEMORY_VARIANTS)} only")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing variants")
    p.add_argument("--memory-child", default=None, choices=list(VARIANT_BY_NAME), help=argparse.SUPPRESS)
    p.add_argument("--config", type=parse_config, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.configs = args.configs or [parse_config("resnet20_gn:8")]
        args.steps = args.steps or 2
        args.warmup, args.rounds, args.mem_steps = 1, 1, min(args.mem_steps, 2)
        args.memory_variants = args.memory_variants or list(SMOKE_MEMORY_VARIANTS)
    args.configs = args.configs or [parse_config(c) for c in DEFAULT_CONFIGS]
    if REFERENCE not in args.variants:
        p.error(f"--variants must include {REFERENCE} (the reference of every ratio)")
    if args.rounds < 1 or (args.steps is not None and args.steps < 1) or args.mem_steps < 1:
        p.error("--steps, --rounds and --mem-steps must be >= 1")
    # What step_time.bench_batch_size reads from its args.
    args.only, args.skip = [], []
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        args.config = args.config or args.configs[0]
        return memory_child(args)

    threads = args.threads or st._cores()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    logcap = st._install_tf_log_capture(False)
    ctx = st.Ctx(dataset_size=args.dataset_size, threads=threads, seed=args.seed)
    machine = st.machine_info(threads)
    machine.update(_git_state())
    print(f"{machine['cpu_model']} | {threads} threads | TF {machine['tensorflow']} | "
          f"load {' '.join(machine['loadavg_start'])}", flush=True)

    t_start = time.perf_counter()
    timing: List[dict] = []
    steps_default = args.steps
    if args.timing_from:  # re-measure memory only; keep an earlier run's timing
        earlier = json.loads(pathlib.Path(args.timing_from).read_text())
        wanted = {tuple(c) for c in args.configs}
        timing = [d for d in earlier["timing"] if (d["model"], d["batch_size"]) in wanted]
        machine["timing_run"] = {k: earlier["machine"].get(k) for k in
                                 ("date_utc", "loadavg_start", "loadavg_end", "wall_s", "git_head", "git_dirty")}
        machine["timing_run"]["command"] = earlier["config"].get("command")
        for key in ("rounds", "warmup", "reentry"):
            setattr(args, key, earlier["config"][key])
        steps_default = earlier["config"]["steps"]
        print(f"timing of {len(timing)} cells from {args.timing_from} ({earlier['machine']['date_utc']})")
    for model_name, bs in ([] if args.timing_from else args.configs):
        args.steps = steps_default or DEFAULT_STEPS[model_name]
        for d in time_config(model_name, bs, args, ctx, logcap):
            d["steps_requested"] = args.steps
            timing.append(d)
        gc.collect()
    args.steps = steps_default if isinstance(steps_default, int) else None
    memory = [] if args.no_memory else measure_memory(args.configs, args)
    machine["loadavg_end"] = (st._read("/proc/loadavg") or "").split()[:3]
    if _git_state() != {k: machine[k] for k in ("git_head", "git_dirty")}:
        machine["git_changed_during_run"] = _git_state()
        print(f"WARNING: the git state changed during the run: {machine['git_changed_during_run']}")
    machine["wall_s"] = round(time.perf_counter() - t_start, 1)

    for model_name, bs in args.configs:
        print(f"\n{model_name}, batch {bs}  (x dp-full: ratio of medians; rounds: range of per-round ratios)")
        print(console_table(timing, memory, model_name, bs))

    if args.out:
        json_path = pathlib.Path(args.out).with_suffix(".json")
    elif args.smoke:
        json_path = pathlib.Path(tempfile.mkdtemp(prefix="sparse_phase_smoke_")) / "sparse_phase-smoke.json"
    else:
        json_path = HERE / "results" / f"sparse_phase-{machine['host']}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items()
              if k not in ("memory_child", "config", "only", "skip", "slow_steps", "slow_max_batch")}
    config["threads"] = threads
    config["steps"] = steps_default or " / ".join(f"{n} ({m})" for m, n in DEFAULT_STEPS.items())
    config["command"] = " ".join([pathlib.Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv)))
    payload = {"machine": machine, "config": config, "targets": TARGETS, "timing": timing, "memory": memory}
    json_path.write_text(json.dumps(payload, indent=1))
    md_path = json_path.with_suffix(".md")
    write_markdown(md_path, payload)
    print(f"\nwrote {json_path} and {md_path} ({machine['wall_s']} s)")

    failed = [d for d in timing if d["status"] == "error"] + [m for m in memory if m["status"] == "error"]
    if failed:
        print("errors: " + "; ".join(f"{d['model']}:{d['batch_size']} {d['variant']}: {d.get('note')}" for d in failed))
    missed = [d for d in timing if d.get("target_met") is False]
    if missed:
        print("targets missed: " + ", ".join(
            f"{d['model']}:{d['batch_size']} {d['variant']} {d['ratio_vs_dp_full']:.2f}x > {d['target_ratio_max']}x"
            for d in missed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
