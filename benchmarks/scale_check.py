#!/usr/bin/env python
"""Scale check: one full DP step of a ViT-B/16-size model (86M parameters, 224x224) at physical batch 32.

Each variant runs in a fresh process (so peak memory is its own): build the
model, run ``--steps`` training steps on random images, and report the peak
resident set size (``VmHWM``), the RSS just before the first step, and the
median step time after the first (tracing) step. Variants:

* ``keras``: the non-private Keras step (the reference);
* ``dp-full``: ``DPModel``'s full DP-SGD step, default engine (book-keeping);
* ``dp-layerwise``: the previous default, per-example gradients materialised
  (expected not to fit: B x 86M x 4 bytes = 11 GB for the gradients alone).

Example::

    python benchmarks/scale_check.py --out benchmarks/results/scale-vit-b16-vm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = ("keras", "dp-full", "dp-layerwise")
VIT_B16 = {"input_shape": (224, 224, 3), "patch_size": 16, "dim": 768, "depth": 12, "heads": 12,
           "mlp_dim": 3072, "num_classes": 1000}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(variant: str, batch: int, steps: int) -> dict:
    """One variant in this (fresh) process; returns its measurements."""
    import numpy as np
    import tensorflow as tf

    from sparta_tf import DPModel
    from sparta_tf.models import vit_tiny

    tf.keras.utils.set_random_seed(0)
    model = vit_tiny(name="vit_b16", **VIT_B16)
    parameters = int(sum(np.prod(v.shape.as_list()) for v in model.trainable_variables))
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if variant == "keras":
        trainer = model
    else:
        trainer = DPModel(model, clip_norm=1.0, noise_multiplier=1.0, sample_rate=batch / 1_000_000,
                          dataset_size=1_000_000, engine="auto" if variant == "dp-full" else "layerwise")
    trainer.compile(tf.keras.optimizers.SGD(0.01, momentum=0.9), loss=loss, jit_compile=False)
    x = tf.random.uniform([batch, *VIT_B16["input_shape"]])
    y = tf.random.uniform([batch], 0, VIT_B16["num_classes"], tf.int32)
    data = (x, y) if variant == "keras" else (x, y, tf.ones([batch]))
    rss_before = _status_kib("VmRSS")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_on_batch(*data)
        times.append(time.perf_counter() - start)
    return {"variant": variant, "parameters": parameters, "batch": batch, "steps": steps,
            "first_step_s": times[0], "median_step_s": float(np.median(times[1:])) if steps > 1 else None,
            "rss_before_mib": rss_before / 1024, "peak_rss_mib": _status_kib("VmHWM") / 1024}


def run_variant(variant: str, batch: int, steps: int, timeout: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", variant, "--batch", str(batch),
               "--steps", str(steps)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "status": f"timed out after {timeout} s"}
    if done.returncode != 0:
        reason = "killed (out of memory?)" if done.returncode < 0 else (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"variant": variant, "status": f"failed: exit {done.returncode}: {reason}",
                "wall_s": time.perf_counter() - start}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), status="ok", wall_s=time.perf_counter() - start)


def report(results: list[dict], batch: int) -> str:
    keras = next((r for r in results if r["variant"] == "keras" and r["status"] == "ok"), None)
    lines = [f"# Scale check: ViT-B/16 size ({results[0].get('parameters', '?')} parameters, 224x224), "
             f"physical batch {batch}", "",
             f"- host `{platform.node()}`, {os.cpu_count()} CPUs; one fresh process per variant",
             "- `peak RSS` = VmHWM of that process (model, data, graph and the steps); `growth` = peak minus "
             "RSS just before the first step", "",
             "| variant | status | step s (median after the first) | first step s | peak RSS MiB | growth MiB | "
             "peak / keras peak |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['status']} | - | - | - | - | - |")
            continue
        growth = r["peak_rss_mib"] - r["rss_before_mib"]
        ratio = f"{r['peak_rss_mib'] / keras['peak_rss_mib']:.2f}" if keras else "-"
        median = f"{r['median_step_s']:.1f}" if r["median_step_s"] else "-"
        lines.append(f"| {r['variant']} | ok | {median} | {r['first_step_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                     f"{growth:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["keras", "dp-full"], choices=VARIANTS,
                        help="default: keras dp-full (dp-layerwise needs ~11 GB more: B x 86M x 4 bytes)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="steps per variant (the first traces)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per variant")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "scale-vit-b16-vm"))
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.steps)))
        return 0
    results = []
    for variant in args.variants:
        results.append(run_variant(variant, args.batch, args.steps, args.timeout))
        print(json.dumps(results[-1]), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"batch": args.batch, "steps": args.steps, "model": VIT_B16, "results": results}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(report(results, args.batch))
    print(f"wrote {args.out}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
