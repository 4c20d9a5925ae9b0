#!/usr/bin/env python
"""Speed and memory of the DP step on the models users bring, against Keras and TF Privacy.

Models (built offline, no weights; ``keras.applications`` ones with ``weights=None`` at the
smallest input each accepts, ``include_top=False`` + average pooling + a Dense head, their
BatchNorm converted to GroupNorm by ``sparta_tf.models.replace_batchnorm``):

  mlp_fused      3072-1024x3-10 written ``Dense(1024, activation="relu")`` (how users write it)
  mlp_split      the same written ``Dense(1024)`` + ``ReLU()``
  resnet20_gn    sparta_tf.models.resnet20_gn, 32x32x3
  wrn16_4_gn     sparta_tf.models.wrn_gn(16, 4)
  vit_tiny       sparta_tf.models.vit_tiny (DeiT-tiny width and depth, patch 4, 65 tokens)
  resnet50v2_gn, mobilenetv2_gn, efficientnetb0_gn, convnext_tiny (LayerNorm: nothing to convert)
  text_transformer  Embedding + 2 x (MultiHeadAttention + LayerNorm + Dense(gelu) + Dense + LayerNorm), 64 tokens
  lstm_classifier   Embedding + LSTM(128) + Dense head, 64 tokens

Variants, per model, all built in one process and timed in interleaved rounds (rotated order,
an untimed re-entry step per block), on the ``fit`` path with full batches of weight 1:

  keras      the non-private Keras step (reference of every ratio)
  keras-noise  the Keras step plus the DP step's noise draw on every parameter: the floor of any
             full DP step (its excess over ``keras`` is what the noise costs)
  dp-full    ``sparta_tf.DPModel`` (default engine and memory budget), every parameter
  dp-two-pass  the same with ``max_memory=0``: no layer output gradient kept (two backward passes)
  sparse-20  the same with 20% of the rows of every maskable kernel + biases/norms/head
  tfp-ghost  TF Privacy's ``DPModel`` with its default layer registry (ghost clipping) where
             every trainable layer is registered, else skipped with the reason
  tfp-plain  TF Privacy's ``DPModel`` without registry (per-example microbatches), no XLA

Per variant: median step ms and its ratio to ``keras``; the peak RSS growth of a fresh
subprocess running it (the high-water mark of steps 2-4, reset after the first step so that
tracing's transient peak is left out, minus the RSS before the first step; the first step's
growth is in the JSON) and its ratio to keras's; for ``dp-full`` the engine's cost table summarised as variables per
norm method. Results are cached per model in the JSON, so a killed run resumes; ``--readme``
rewrites the speed table of the docs page ``docs/speed.md`` between its markers from the JSON.

    python benchmarks/zoo_speed.py                          # every model (hours on 2 cores)
    python benchmarks/zoo_speed.py --models mlp_fused resnet20_gn --rounds 2
    python benchmarks/zoo_speed.py --smoke                  # CI-sized: tiny shapes, 1 round
    python benchmarks/zoo_speed.py --readme-only            # docs/speed.md's table from the committed JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time
from collections import Counter
from typing import Callable, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from sparta_tf import DPModel, methods  # noqa: E402
from sparta_tf.backend import KERAS3, keras_version  # noqa: E402
from sparta_tf.dp_step.noise import gaussian_noise  # noqa: E402
from sparta_tf.groups import row_groups  # noqa: E402
from sparta_tf.keras_layers import all_layers  # noqa: E402
from sparta_tf.models import replace_batchnorm, resnet20_gn, vit_tiny, wrn_gn  # noqa: E402
from sparta_tf.selection import random_selections  # noqa: E402

L = tf.keras.layers
CLASSES = 10
LR, MOMENTUM, CLIP_NORM, NOISE_MULTIPLIER = 0.01, 0.9, 1.0, 1.0
POOL = 3  # distinct random batches cycled through
DATASET_SIZE = 50_000
RESULTS = HERE / "results" / "zoo_speed-vm"
README = ROOT / "docs" / "speed.md"  # the page whose table --readme / --readme-only rewrite
RESULTS_KERAS3 = HERE / "results" / "zoo_speed-keras3-vm"  # the default --out on the Keras 3 line


README_BEGIN, README_END = "<!-- zoo-speed:begin -->", "<!-- zoo-speed:end -->"
README_KERAS3_BEGIN, README_KERAS3_END = "<!-- zoo-speed-keras3:begin -->", "<!-- zoo-speed-keras3:end -->"


def readme_markers(results_path: pathlib.Path) -> tuple[str, str]:
    """The markers of docs/speed.md between which the table of ``results_path`` goes (one pair per line)."""
    return (README_KERAS3_BEGIN, README_KERAS3_END) if "keras3" in results_path.name else (README_BEGIN, README_END)
# model -> the largest acceptable dp-full / keras step ratio (issue targets; 2.0 for every other model)
TIME_TARGETS = {"mlp_fused": 1.5, "mlp_split": 1.5, "resnet20_gn": 1.3, "vit_tiny": 1.5}
MEMORY_TARGETS = {"resnet20_gn": 1.5}  # dp-full / keras peak RSS growth (2.0 for every other model)
DEFAULT_TIME_TARGET = DEFAULT_MEMORY_TARGET = 2.0
FLOOR_TARGET = 1.05  # MLPs: dp-full / keras-noise (the Keras step plus the same noise draw)


class Unavailable(Exception):
    """A variant that cannot run on a model (printed as skipped, with the reason)."""


# ---------------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class ZooModel:
    build: Callable[[], tf.keras.Model]
    input_shape: tuple
    batch: int
    steps: int  # timed steps per variant
    ids: int = 0  # > 0: integer token inputs with this vocabulary


def _head(features) -> tf.Tensor:
    return L.Dense(CLASSES, name="head")(features)


def _mlp(fused: bool) -> tf.keras.Model:
    layers = [tf.keras.Input((32, 32, 3)), L.Flatten()]
    for _ in range(3):
        layers += [L.Dense(1024, activation="relu")] if fused else [L.Dense(1024), L.ReLU()]
    return tf.keras.Sequential(layers + [L.Dense(CLASSES, name="head")], name="mlp_fused" if fused else "mlp_split")


def _application(name: str, size: int = 32) -> Callable[[], tf.keras.Model]:
    def build():
        backbone = getattr(tf.keras.applications, name)(weights=None, include_top=False, pooling="avg",
                                                        input_shape=(size, size, 3))
        model = tf.keras.Model(backbone.input, _head(backbone.output))
        return replace_batchnorm(model, "groupnorm")
    return build


def _text_transformer(vocab: int = 2000, tokens: int = 64, dim: int = 128, heads: int = 4, blocks: int = 2):
    ids = tf.keras.Input((tokens,), dtype=tf.int32)
    h = L.Embedding(vocab, dim)(ids)
    for _ in range(blocks):
        attended = L.MultiHeadAttention(heads, dim // heads)(h, h)
        h = L.LayerNormalization()(h + attended)
        mlp = L.Dense(dim)(L.Dense(2 * dim, activation="gelu")(h))
        h = L.LayerNormalization()(h + mlp)
    return tf.keras.Model(ids, _head(L.GlobalAveragePooling1D()(h)), name="text_transformer")


def _lstm_classifier(vocab: int = 2000, tokens: int = 64):
    ids = tf.keras.Input((tokens,), dtype=tf.int32)
    return tf.keras.Model(ids, _head(L.LSTM(128)(L.Embedding(vocab, 64)(ids))), name="lstm_classifier")


IMAGE = (32, 32, 3)
MODELS: Dict[str, ZooModel] = {
    "mlp_fused": ZooModel(lambda: _mlp(True), IMAGE, 256, 10),
    "mlp_split": ZooModel(lambda: _mlp(False), IMAGE, 256, 10),
    "resnet20_gn": ZooModel(lambda: resnet20_gn(input_shape=IMAGE, num_classes=CLASSES), IMAGE, 128, 10),
    "wrn16_4_gn": ZooModel(lambda: wrn_gn(depth=16, width=4, input_shape=IMAGE, num_classes=CLASSES), IMAGE, 64, 5),
    "vit_tiny": ZooModel(lambda: vit_tiny(num_classes=CLASSES, input_shape=IMAGE), IMAGE, 256, 4),
    "resnet50v2_gn": ZooModel(_application("ResNet50V2"), IMAGE, 32, 5),
    "mobilenetv2_gn": ZooModel(_application("MobileNetV2"), IMAGE, 64, 5),
    "efficientnetb0_gn": ZooModel(_application("EfficientNetB0"), IMAGE, 32, 5),
    "convnext_tiny": ZooModel(_application("ConvNeXtTiny"), IMAGE, 32, 4),
    "text_transformer": ZooModel(_text_transformer, (64,), 64, 8, ids=2000),
    "lstm_classifier": ZooModel(_lstm_classifier, (64,), 64, 6, ids=2000),
}
SMOKE = {"mlp_fused": ZooModel(lambda: _mlp(True), IMAGE, 8, 2),
         "lstm_classifier": ZooModel(lambda: _lstm_classifier(50, 8), (8,), 8, 2, ids=50)}


def _pool(spec: ZooModel, seed: int):
    rng = np.random.default_rng(seed)
    if spec.ids:
        x = rng.integers(1, spec.ids, size=(POOL, spec.batch) + spec.input_shape).astype(np.int32)
    else:
        x = rng.random((POOL, spec.batch) + spec.input_shape, dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(POOL, spec.batch)).astype(np.int32)
    return x, y


def _dataset(spec: ZooModel, seed: int, with_weights: bool) -> tf.data.Dataset:
    x, y = _pool(spec, seed)
    parts = (x, y, np.ones((POOL, spec.batch), np.float32)) if with_weights else (x, y)
    return tf.data.Dataset.from_tensor_slices(parts).repeat()


# -------------------------------------------------------------------------------- variants


Step = Callable[[], float]


def _fit_path_step(model: tf.keras.Model, ds: tf.data.Dataset) -> Step:
    iterator = iter(ds)
    model.make_train_function()  # Keras 3 sets model.train_function and returns None
    train_function = model.train_function

    def step() -> float:
        return float(tf.nest.flatten(train_function(iterator))[0])

    return step


def _sgd():
    return tf.keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)


def _xent():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_keras(model, spec, seed):
    model.compile(optimizer=_sgd(), loss=_xent())
    return _fit_path_step(model, _dataset(spec, seed, False)), None


class NoisyKerasModel(tf.keras.Model):
    """The non-private Keras step plus the DP step's noise draw: ``N(0, (sigma C / B)^2)`` on every
    trainable coordinate, drawn as the DP step draws it (stateless Philox, one key per tensor). No
    DP step can be faster than this floor: it trains every coordinate and draws the same noise."""

    def __init__(self, model: tf.keras.Model):
        super().__init__()
        self.model = model
        self.noise_step = tf.Variable(0, dtype=tf.int64, trainable=False)

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self.model(x, training=True))
        variables = self.model.trainable_variables
        gradients = tape.gradient(loss, variables)
        stddev = NOISE_MULTIPLIER * CLIP_NORM / tf.cast(tf.shape(y)[0], tf.float32)
        noise = gaussian_noise([v.shape for v in variables], stddev, tf.constant(0, tf.int64), self.noise_step)
        self.noise_step.assign_add(1)
        self.optimizer.apply_gradients(zip([g + z for g, z in zip(gradients, noise)], variables))
        return {"loss": loss}


def make_keras_noise(model, spec, seed):
    noisy = NoisyKerasModel(model)
    noisy.compile(optimizer=_sgd(), loss=_xent())
    return _fit_path_step(noisy, _dataset(spec, seed, False)), None


def _ours(model, spec, seed, configure=None, max_memory=None, **options):
    dp = DPModel(model, clip_norm=CLIP_NORM, noise_multiplier=NOISE_MULTIPLIER,
                 sample_rate=spec.batch / DATASET_SIZE, dataset_size=DATASET_SIZE, max_memory=max_memory, **options)
    dp.compile(optimizer=_sgd(), loss=_xent())
    if configure is not None:
        configure(dp)
    return _fit_path_step(dp, _dataset(spec, seed, True)), dp


def make_dp_full(model, spec, seed):
    return _ours(model, spec, seed)


def make_dp_two_pass(model, spec, seed):
    """``max_memory=0``: no layer output gradient kept (norms and sums inside two backward passes)."""
    return _ours(model, spec, seed, max_memory=0)


def make_sparse_20(model, spec, seed):
    def configure(dp):
        mask = random_selections(row_groups(model), 0.2, "row", seed=seed)
        dp.set_trainable_set(methods.trainable_set(model, "random", mask))
    return _ours(model, spec, seed, configure)


def _tf_privacy():
    try:
        from tensorflow_privacy.privacy.fast_gradient_clipping import gradient_clipping_utils, layer_registry
        from tensorflow_privacy.privacy.keras_models.dp_keras_model import make_dp_model_class
    except ImportError as error:
        raise Unavailable(f"TF Privacy is not installed ({error}); it runs on the TF 2.15 line only")
    return make_dp_model_class, layer_registry, gradient_clipping_utils


PLAIN_BUDGET_GIB = 2.0  # TF Privacy's plain DPModel holds B per-example gradients of every parameter


def _tfp(model, spec, seed, ghost: bool):
    make_dp_model_class, layer_registry, utils = _tf_privacy()
    needed = spec.batch * sum(int(np.prod(v.shape)) for v in model.trainable_variables) * 4 / 2**30
    if not ghost and needed > PLAIN_BUDGET_GIB:
        raise Unavailable(f"its per-example gradients would hold {needed:.1f} GiB (B x parameters x 4 bytes; "
                          f"budget {PLAIN_BUDGET_GIB:g} GiB on this 24 GiB machine)")
    registry = layer_registry.make_default_layer_registry() if ghost else None
    if ghost and not utils.all_trainable_layers_are_registered(model, registry):
        unregistered = sorted({type(l).__name__ for l in model._flatten_layers(include_self=False)
                               if l.trainable_weights and not registry.is_elem(l)})
        raise Unavailable(f"layers outside TF Privacy's default registry: {', '.join(unregistered)}")
    dp = make_dp_model_class(tf.keras.Model)(l2_norm_clip=CLIP_NORM, noise_multiplier=NOISE_MULTIPLIER,
                                             num_microbatches=None, use_xla=False, layer_registry=registry,
                                             inputs=model.inputs, outputs=model.outputs)
    dp.compile(optimizer=_sgd(), loss=_xent())  # fast clipping refuses unreduced losses
    return _fit_path_step(dp, _dataset(spec, seed, False)), None


VARIANTS: Dict[str, Callable] = {
    "keras": make_keras,
    "keras-noise": make_keras_noise,
    "dp-full": make_dp_full,
    "dp-two-pass": make_dp_two_pass,
    "sparse-20": make_sparse_20,
    "tfp-ghost": lambda model, spec, seed: _tfp(model, spec, seed, ghost=True),
    "tfp-plain": lambda model, spec, seed: _tfp(model, spec, seed, ghost=False),
}


def _fresh(spec: ZooModel, seed: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    return spec.build()


def cost_summary(dp) -> Dict[str, int]:
    """Variables per norm method of the engine's last traced step."""
    return dict(sorted(Counter(row.method for row in dp.engine_cost_table()).items()))


# ---------------------------------------------------------------------------------- timing


def time_model(name: str, spec: ZooModel, variants: List[str], rounds: int, seed: int,
               registry: Optional[Dict[str, Callable]] = None) -> dict:
    """Every variant of ``variants`` (factories in ``registry``, default :data:`VARIANTS`) built, then
    timed in ``rounds`` interleaved rounds (rotated order, an untimed re-entry step per block)."""
    result = {"model": name, "batch_size": spec.batch, "commit": _commit(), "variants": {}}
    built = build_variants(name, spec, variants, seed, result, registry)
    names = list(built)
    for round_ in range(rounds):
        for variant in names[round_ % len(names):] + names[: round_ % len(names)] if names else []:
            step, times = built[variant], result["variants"][variant]["times_ms"]
            step()  # re-entry
            for _ in range(math.ceil(spec.steps / rounds)):
                t = time.perf_counter()
                step()
                times.append(1000 * (time.perf_counter() - t))
        print(f"  {name} round {round_ + 1}/{rounds} done", flush=True)
    for variant, entry in result["variants"].items():
        if entry.get("times_ms"):
            entry["median_ms"] = float(np.median(entry["times_ms"]))
    keras = result["variants"].get("keras", {}).get("median_ms")
    for entry in result["variants"].values():
        if keras and entry.get("median_ms"):
            entry["ratio_to_keras"] = entry["median_ms"] / keras
    if "dp-full" in names and "keras" in names:
        terms = conv_terms(spec, seed, built["keras"])
        if terms is not None:
            result["conv_terms"] = terms
    built.clear()
    tf.keras.backend.clear_session()
    gc.collect()
    return result


def build_variants(name: str, spec: ZooModel, variants: List[str], seed: int, result: dict,
                   registry: Optional[Dict[str, Callable]] = None) -> Dict[str, Step]:
    """``{variant: step}`` of the variants that built and ran two untimed steps (tracing, warm-up);
    each variant's entry in ``result["variants"]`` says ok (with ``times_ms`` to fill), skipped or
    error, and for a DP step its norm methods."""
    registry = VARIANTS if registry is None else registry
    built = {}
    for variant in variants:
        entry = result["variants"].setdefault(variant, {})
        t0 = time.perf_counter()
        try:
            model = _fresh(spec, seed)
            result["parameters"] = int(sum(np.prod(v.shape) for v in model.trainable_variables))
            step, dp = registry[variant](model, spec, seed)
            for _ in range(2):  # tracing and warm-up are never timed
                loss = step()
            if not math.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss}")
        except Unavailable as error:
            entry.update(status="skipped", note=str(error))
            print(f"  {name} {variant:10s} skipped: {error}", flush=True)
            continue
        except Exception as error:  # noqa: BLE001 -- a variant's failure is a result, reported
            entry.update(status="error", note=_error_line(error))
            print(f"  {name} {variant:10s} ERROR: {entry['note']}", flush=True)
            continue
        entry.update(status="ok", setup_s=round(time.perf_counter() - t0, 1), times_ms=[])
        if dp is not None:
            entry["norm_methods"] = cost_summary(dp)
        built[variant] = step
        print(f"  {name} {variant:10s} ready ({entry['setup_s']} s)", flush=True)
    return built


# ------------------------------------------------------------------------- the conv term


def _conv_calls(model: tf.keras.Model) -> list:
    """``(layer, input shape, output shape)`` of every ``Conv2D`` (``groups = 1``) the model calls."""
    calls = []
    for layer in all_layers(model):
        if type(layer) is L.Conv2D and layer.groups == 1:
            calls.append((layer, tuple(layer.input.shape[1:]), tuple(layer.output.shape[1:])))
    return calls


def conv_terms(spec: ZooModel, seed: int, keras_step: Step, repeats: int = 7) -> Optional[dict]:
    """What the per-example kernel gradients cost against the filter gradients they replace.

    For every ``Conv2D`` call of the model, on random tensors of its input and output shapes at the
    benchmark batch: the batch filter gradient (``Conv2DBackpropFilter``: what the Keras step
    computes for the kernel) and the DP step's per-example work for the same kernel (the
    book-keeping rule's squared norms, with the per-example gradients it materialises), each
    one ``tf.function`` over all the layers, timed interleaved with ``keras_step`` (median of
    ``repeats``). Their difference is a term of the DP step that nothing else in it can hide: the
    step's time is at least ``keras - filter + per_example`` (the rest of the Keras step stays)."""
    from sparta_tf.per_example.rules.base import RecordedCall
    from sparta_tf.per_example.rules.conv2d import Conv2DGhostRule
    from sparta_tf.trainable import dense

    calls = _conv_calls(_fresh(spec, seed))
    if not calls:
        return None
    rng = tf.random.Generator.from_seed(seed)
    tensors = [(rng.normal((spec.batch,) + shape_in), rng.normal((spec.batch,) + shape_out))
               for _, shape_in, shape_out in calls]
    rule = Conv2DGhostRule()

    @tf.function
    def filter_gradients():
        return [tf.compat.v1.nn.conv2d_backprop_filter(
            a, layer.kernel.shape, d, strides=[1, *layer.strides, 1], padding=layer.padding.upper())
            for (layer, _, _), (a, d) in zip(calls, tensors)]

    @tf.function
    def per_example():
        return [rule.squared_norms(layer, RecordedCall(layer, (a,), {}, None, None), d, [dense(layer.kernel)], {})[0]
                for (layer, _, _), (a, d) in zip(calls, tensors)]

    def run(fn):
        return lambda: [out.numpy() for out in fn()]

    timed = {"keras": keras_step, "filter": run(filter_gradients), "per_example": run(per_example)}
    times: Dict[str, list] = {name: [] for name in timed}
    for fn in timed.values():
        fn()  # traced, never timed
    for _ in range(repeats):
        for name, fn in timed.items():
            t = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - t))
    return {"layers": len(calls), **{f"{name}_ms": float(np.median(t)) for name, t in times.items()}}


# ---------------------------------------------------------------------------------- memory


def _status_kib(field: str) -> Optional[int]:
    try:
        text = pathlib.Path("/proc/self/status").read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith(field + ":")), None)
    return int(line.split()[1]) if line else None


def memory_child(name: str, variant: str, smoke: bool, seed: int) -> int:
    """In a fresh process: build one variant, run 3 steps, print the peak RSS growth (VmHWM), the RSS
    the first step (tracing included) left behind, and the allocator's growth in one more step."""
    spec = (SMOKE if smoke else MODELS)[name]
    step, _ = VARIANTS[variant](_fresh(spec, seed), spec, seed)
    gc.collect()
    before = _status_kib("VmRSS")
    step()  # traces, then runs
    first, after_first = _status_kib("VmHWM"), _status_kib("VmRSS")
    try:  # reset the high-water mark to the current RSS: the next peak is the steps', not tracing's
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    for _ in range(3):
        step()
    measured = {"growth_mib": (_status_kib("VmHWM") - before) / 1024, "first_step_growth_mib": (first - before) / 1024,
                "after_first_step_mib": (after_first - before) / 1024}
    allocator = allocator_growth_mib(step)
    if allocator is not None:
        measured["allocator_growth_mib"] = allocator
    print("MEMORY-RESULT " + json.dumps(measured), flush=True)
    return 0


def allocator_growth_mib(step: Step) -> Optional[float]:
    """One more step under TensorFlow's profiler: the CPU allocator's peak bytes in use minus its
    least (the weights and state that live between steps), in MiB. What the step's own tensors take
    at their peak, without the process's graphs, code and heap slack that RSS also counts: on a
    GPU, the device memory the step needs. None where the profiler's memory view is unavailable."""
    import glob
    import tempfile

    try:
        from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as convert
    except ImportError:
        from tensorflow.python.profiler.internal import _pywrap_profiler as convert
    if not hasattr(convert, "xspace_to_tools_data"):
        return None
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        step()
        tf.profiler.experimental.stop()
        planes = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        if not planes:
            return None
        profile = json.loads(convert.xspace_to_tools_data(planes, "memory_profile")[0])
    growth = []
    for allocator in profile.get("memoryProfilePerAllocator", {}).values():
        snapshots = allocator.get("memoryProfileSnapshots", [])
        peak = int(allocator.get("profileSummary", {}).get("peakStats", {}).get("peakBytesInUse", 0))
        if snapshots and peak:
            least = min(int(s["aggregationStats"].get("heapAllocatedBytes", 0)) for s in snapshots)
            growth.append(peak - least)
    return max(growth) / 2**20 if growth else None


def measure_memory(name: str, variants: List[str], result: dict, smoke: bool, seed: int) -> None:
    for variant in variants:
        entry = result["variants"].get(variant, {})
        if entry.get("status") != "ok":
            continue
        command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--memory-child", name, variant,
                   "--seed", str(seed)] + (["--smoke"] if smoke else [])
        process = subprocess.run(command, capture_output=True, text=True)
        line = next((ln for ln in process.stdout.splitlines() if ln.startswith("MEMORY-RESULT ")), None)
        if line:
            measured = json.loads(line.split(" ", 1)[1])
            entry["memory_growth_mib"] = measured["growth_mib"]
            entry["first_step_memory_growth_mib"] = measured["first_step_growth_mib"]
            for key in ("allocator_growth_mib", "after_first_step_mib"):  # absent from older children
                if key in measured:
                    entry[key] = measured[key]
        else:
            entry["memory_note"] = (process.stderr.strip().splitlines() or ["?"])[-1][:300]
    keras = result["variants"].get("keras", {})
    for entry in result["variants"].values():
        for measure, ratio in (("memory_growth_mib", "memory_ratio_to_keras"),
                               ("allocator_growth_mib", "allocator_ratio_to_keras")):
            if keras.get(measure) and entry.get(measure) is not None:
                entry[ratio] = entry[measure] / keras[measure]


# ------------------------------------------------------------------------------- reporting


def _verdicts(result: dict) -> List[str]:
    """The issue's targets for this model, met or not (time: the default step; memory: the default
    step, or the two-pass step where the default is over the target)."""
    variants = result["variants"]
    ours, two_pass = variants.get("dp-full", {}), variants.get("dp-two-pass", {})
    out = []
    ratio = ours.get("ratio_to_keras")
    target = TIME_TARGETS.get(result["model"], DEFAULT_TIME_TARGET)
    if ratio is not None:
        out.append(f"time <= {target:g}x: {'met' if ratio <= target else 'NOT met'}")
    floor = variants.get("keras-noise", {}).get("median_ms")
    if result["model"].startswith("mlp") and floor and ours.get("median_ms"):
        over = ours["median_ms"] / floor
        out.append(f"<= {FLOOR_TARGET:g}x the noise floor: {'met' if over <= FLOOR_TARGET else 'NOT met'} ({over:.2f}x)")
    memory_target = MEMORY_TARGETS.get(result["model"], DEFAULT_MEMORY_TARGET)
    memory = ours.get("memory_ratio_to_keras")
    if memory is not None:
        verdict = f"memory <= {memory_target:g}x: {'met' if memory <= memory_target else 'NOT met'}"
        lean = two_pass.get("memory_ratio_to_keras")
        if memory > memory_target and lean is not None:
            verdict += f" (two passes: {'met' if lean <= memory_target else 'NOT met'}, {lean:.2f}x)"
        tensors = ours.get("allocator_ratio_to_keras")
        if memory > memory_target and tensors is not None:
            verdict += f"; step tensors {tensors:.2f}x: {'met' if tensors <= memory_target else 'NOT met'}"
        out.append(verdict)
    ghost = variants.get("tfp-ghost", {}).get("median_ms")
    if result["model"].startswith("mlp") and ghost and ours.get("median_ms"):
        speedup = ghost / ours["median_ms"]
        out.append(f">= 2x faster than TF Privacy ghost: {'met' if speedup >= 2 else 'NOT met'} ({speedup:.2f}x)")
    if "per_layer_vjp" in ours.get("norm_methods", {}):
        out.append(f"{ours['norm_methods']['per_layer_vjp']} variables on the per-layer VJP fallback")
    return out


def _cell(entry: dict) -> str:
    if entry.get("status") == "skipped":
        return "n/a"
    if entry.get("status") == "error":
        return "error"
    if "ratio_to_keras" not in entry:
        return "-"
    memory = entry.get("memory_ratio_to_keras")
    return f"{entry['ratio_to_keras']:.2f}x" + (f" / {memory:.2f}x" if memory is not None else "")


def _allocator_cell(variants: dict) -> str:
    ratios = [variants.get(name, {}).get("allocator_ratio_to_keras") for name in ("dp-full", "dp-two-pass")]
    return ", ".join("-" if r is None else f"{r:.2f}x" for r in ratios) if any(r is not None for r in ratios) else "-"


def markdown(results: List[dict], machine: str) -> str:
    lines = [
        f"DP step time / peak memory growth as multiples of the Keras non-private step's, same process "
        f"(memory: a fresh process per variant), {machine}. Targets from the issue: MLPs <= 1.5x, "
        "ResNet-20-GN <= 1.3x with memory <= 1.5x, ViT-tiny <= 1.5x, every other model <= 2x in time "
        "and memory, MLPs within 1.05x of the floor (the Keras step plus the DP step's noise draw). "
        "Two passes: ``max_memory=0``, no layer output gradient kept. Memory is the RSS high-water "
        "mark's growth (what the process takes, its graphs and heap slack included); `step tensors` is "
        "the growth of TensorFlow's allocator at its peak in one step (profiler; what a GPU would hold), "
        "full DP and two passes, as multiples of the Keras step's.",
        "",
        "| model | B | params | Keras step | Keras + noise (floor) | sparta-tf full DP | two passes | "
        "step tensors | sparta-tf 20% rows | TF Privacy ghost | TF Privacy plain | norm methods (full DP) | targets |",
        "|---|---:|---:|---:|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        v = r["variants"]
        keras = v.get("keras", {})
        keras_cell = f"{keras['median_ms']:.0f} ms" if keras.get("median_ms") else "-"
        if keras.get("memory_growth_mib") is not None:
            keras_cell += f", {keras['memory_growth_mib']:.0f} MiB"
        methods_cell = ", ".join(f"{k} {n}" for k, n in v.get("dp-full", {}).get("norm_methods", {}).items())
        commits = r.get("commit", "") + (f"; memory {r['memory_commit']}" if r.get("memory_commit") else "")
        lines.append(f"| {r['model']}{' (' + commits + ')' if commits else ''} | {r['batch_size']} | {r.get('parameters', 0) / 1e6:.2f}M | {keras_cell} | "
                     f"{_cell(v.get('keras-noise', {}))} | {_cell(v.get('dp-full', {}))} | "
                     f"{_cell(v.get('dp-two-pass', {}))} | {_allocator_cell(v)} | {_cell(v.get('sparse-20', {}))} | "
                     f"{_cell(v.get('tfp-ghost', {}))} | {_cell(v.get('tfp-plain', {}))} | {methods_cell} | "
                     f"{'; '.join(_verdicts(r))} |")
    bounds = [_conv_bound(r) for r in results if r.get("conv_terms")]
    if bounds:
        lines += ["", "The conv term (`conv_terms`: every Conv2D's batch filter gradient, which the Keras step "
                  "computes, against the DP step's per-example kernel gradients and norms for the same layers, "
                  "one process, interleaved): the DP step takes about the Keras step minus the first plus "
                  "the second, at least.", ""] + bounds
    skipped = [f"{r['model']} {k}: {e['note']}" for r in results for k, e in r["variants"].items()
               if e.get("status") in ("skipped", "error")]
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def _conv_bound(result: dict) -> str:
    terms = result["conv_terms"]
    keras = terms["keras_ms"]
    floor = (keras - terms["filter_ms"] + terms["per_example_ms"]) / keras
    return (f"- {result['model']}: {terms['layers']} Conv2D layers, filter gradients {terms['filter_ms']:.0f} ms, "
            f"per-example kernel gradients and norms {terms['per_example_ms']:.0f} ms "
            f"({terms['per_example_ms'] / terms['filter_ms']:.1f}x), Keras step {keras:.0f} ms: "
            f"at least {floor:.2f}x the Keras step")


def update_readme(table: str, results_path: pathlib.Path) -> None:
    begin, end = readme_markers(results_path)
    text = README.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{README.relative_to(ROOT)} has no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    README.write_text(f"{head}{begin}\n{table}{end}{tail}")


def _commit() -> str:
    """The code's commit (the row of a model measured before a later change says so)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _machine() -> str:
    return f"{os.cpu_count()} CPU cores, TensorFlow {tf.__version__}, Keras {keras_version()}"



def _error_line(error: Exception) -> str:
    """One line for a failed variant: the innermost ``...Error: message`` line of a TensorFlow
    "in user code" trace, else the first line of the message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    inner = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line)]
    return (inner[-1] if inner else f"{type(error).__name__}: {lines[0] if lines else ''}")[:300]

def _write(out: pathlib.Path, results: Dict[str, dict]) -> None:
    """The JSON and its markdown table, models in the zoo's order."""
    ordered = [results[n] for n in MODELS if n in results] + [r for n, r in results.items() if n not in MODELS]
    payload = {"machine": _machine(), "results": ordered}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    out.with_suffix(".md").write_text(markdown(ordered, payload["machine"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_KERAS3 if KERAS3 else RESULTS,
                        help="results path without suffix (default: zoo_speed-vm, zoo_speed-keras3-vm on Keras 3)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true",
                        help="measure memory again for the cached results of the models asked for (times kept)")
    parser.add_argument("--rerun", action="store_true", help="ignore cached results of the models asked for")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 1 round (CI)")
    parser.add_argument("--readme", action="store_true", help="also rewrite the speed table of docs/speed.md")
    parser.add_argument("--readme-only", action="store_true",
                        help="only rewrite the speed table of docs/speed.md from the JSON")
    parser.add_argument("--memory-child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        return memory_child(*args.memory_child, args.smoke, args.seed)
    json_path = args.out.with_suffix(".json")
    cached = json.loads(json_path.read_text()) if json_path.exists() else {"results": []}
    if args.readme_only:
        update_readme(markdown(cached["results"], cached.get("machine", "")), args.out)
        return 0
    zoo = SMOKE if args.smoke else {name: MODELS[name] for name in args.models}
    rounds = 1 if args.smoke else args.rounds
    results = {r["model"]: r for r in cached["results"]}
    for name, spec in zoo.items():
        if args.memory_only and name in results:
            print(f"{name}: memory only (times kept from {results[name].get('commit', '?')})", flush=True)
            measure_memory(name, list(results[name]["variants"]), results[name], args.smoke, args.seed)
            results[name]["memory_commit"] = _commit()
            _write(args.out, results)
            continue
        if name in results and not args.rerun and not args.smoke:
            print(f"{name}: cached (--rerun to measure again)", flush=True)
            continue
        print(f"{name} (B={spec.batch})", flush=True)
        result = time_model(name, spec, args.variants, rounds, args.seed)
        if not args.no_memory:
            measure_memory(name, args.variants, result, args.smoke, args.seed)
        results[name] = result
        _write(args.out, results)
        print("  " + "; ".join(_verdicts(result)), flush=True)
    if args.readme:
        update_readme(markdown(json.loads(json_path.read_text())["results"], _machine()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
