#!/usr/bin/env python
"""Per-example kernel gradients of a 3x3 convolution, every formulation we tried, against the
batch filter gradient they replace.

The book-keeping step needs each example's kernel gradient ``dL_i/dK = sum_{h,w} a~_i[h+u, w+v]
delta_i[h, w]^T`` of a convolution whose norm is not cheaper by the ghost norm (large maps);
the Keras step computes only their sum, one ``Conv2DBackpropFilter``. On ResNet-20-GN's three
stage shapes at ``B = 128`` this times, interleaved in one process (median of ``--repeats``):

  filter         the batch filter gradient (the Keras step's op; the reference)
  shifted        what the engine runs: one batched matmul per kernel tap on strided views of the
                 padded input (``sparta_tf.per_example.rules.conv2d.kernel_grads_shifted``)
  im2col         ``tf.image.extract_patches`` and one batched matmul
  row_offsets    one matmul per kernel row: the padded input's row band against the output
                 gradient shifted by each kernel column (6 copies instead of 9)
  per_example_filter  ``tf.map_fn`` of ``Conv2DBackpropFilter`` over the examples
  grouped        the examples folded into the channels: one grouped filter gradient (groups = B;
                 TensorFlow's CPU kernel takes groups only with oneDNN on)
  depthwise      the input laid out ``[c, H, W, B]`` and one depthwise correlation with the
                 output gradients as filters (channel multiplier = output channels)

Every formulation's values are checked against ``shifted`` (max abs difference printed).

    python benchmarks/conv_formulations.py            # writes results/conv_formulations-vm.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from sparta_tf.per_example.rules.conv2d import kernel_grads_shifted, padded_input  # noqa: E402

SHAPES = [(32, 16, 16), (16, 32, 32), (8, 64, 64)]  # (map size, input channels, output channels)
BATCH = 128
RESULTS = HERE / "results" / "conv_formulations-vm"


def _formulations(layer, size: int, c_in: int, c_out: int) -> dict:
    batch = BATCH

    def filter_gradient(a, d):
        return tf.compat.v1.nn.conv2d_backprop_filter(a, [3, 3, c_in, c_out], d, [1, 1, 1, 1], "SAME")

    def im2col(a, d):
        patches = tf.image.extract_patches(a, [1, 3, 3, 1], [1, 1, 1, 1], [1, 1, 1, 1], "SAME")
        return tf.matmul(tf.reshape(patches, [batch, -1, 9 * c_in]), tf.reshape(d, [batch, -1, c_out]),
                         transpose_a=True)

    def row_offsets(a, d):
        padded = padded_input(layer, a, d.dtype)
        width = padded.shape[2]
        shifted = tf.concat([tf.pad(d, [[0, 0], [0, 0], [v, width - size - v], [0, 0]]) for v in range(3)], -1)
        shifted = tf.reshape(shifted, [batch, size * width, 3 * c_out])
        rows = []
        for u in range(3):
            band = tf.reshape(padded[:, u:u + size], [batch, size * width, c_in])
            g = tf.reshape(tf.matmul(band, shifted, transpose_a=True), [batch, c_in, 3, c_out])
            rows.append(tf.transpose(g, [0, 2, 1, 3]))
        return tf.reshape(tf.stack(rows, 1), [batch, 9 * c_in, c_out])

    def per_example_filter(a, d):
        return tf.map_fn(lambda t: tf.compat.v1.nn.conv2d_backprop_filter(
            t[0][None], [3, 3, c_in, c_out], t[1][None], [1, 1, 1, 1], "SAME"), (a, d),
            fn_output_signature=tf.float32, parallel_iterations=16)

    def grouped(a, d):
        x = tf.reshape(tf.transpose(a, [1, 2, 0, 3]), [1, size, size, batch * c_in])
        dy = tf.reshape(tf.transpose(d, [1, 2, 0, 3]), [1, size, size, batch * c_out])
        k = tf.compat.v1.nn.conv2d_backprop_filter(x, [3, 3, c_in, batch * c_out], dy, [1, 1, 1, 1], "SAME")
        return tf.transpose(tf.reshape(k, [3, 3, c_in, batch, c_out]), [3, 0, 1, 2, 4])

    def depthwise(a, d):
        x = tf.transpose(tf.pad(a, [[0, 0], [1, 1], [1, 1], [0, 0]]), [3, 1, 2, 0])
        y = tf.nn.depthwise_conv2d(x, tf.transpose(d, [1, 2, 0, 3]), [1, 1, 1, 1], "VALID")  # [c_in, 3, 3, B*c_out]
        return tf.transpose(tf.reshape(y, [c_in, 3, 3, batch, c_out]), [3, 1, 2, 0, 4])

    return {"filter": filter_gradient, "shifted": lambda a, d: kernel_grads_shifted(layer, a, d),
            "im2col": im2col, "row_offsets": row_offsets, "per_example_filter": per_example_filter,
            "grouped": grouped, "depthwise": depthwise}


def measure(size: int, c_in: int, c_out: int, repeats: int) -> dict:
    layer = tf.keras.layers.Conv2D(c_out, 3, padding="same")
    a = tf.random.stateless_normal([BATCH, size, size, c_in], [0, 1])
    d = tf.random.stateless_normal([BATCH, size, size, c_out], [0, 2])
    layer(a)
    functions = {name: tf.function(fn) for name, fn in _formulations(layer, size, c_in, c_out).items()}
    reference = tf.reshape(functions["shifted"](a, d), [BATCH, 3, 3, c_in, c_out]).numpy()
    result: dict = {}
    for name, fn in list(functions.items()):
        try:
            out = fn(a, d).numpy()
        except Exception as error:  # noqa: BLE001 -- a formulation TensorFlow refuses here is a result
            result[name] = {"error": str(error).strip().splitlines()[0][:160]}
            del functions[name]
            continue
        result[name] = {"times_ms": []}
        if name != "filter":
            result[name]["max_abs_difference"] = float(np.max(np.abs(out.reshape(reference.shape) - reference)))
    for _ in range(repeats):
        for name, fn in functions.items():
            t = time.perf_counter()
            fn(a, d).numpy()
            result[name]["times_ms"].append(1000 * (time.perf_counter() - t))
    for entry in result.values():
        if entry.get("times_ms"):
            entry["median_ms"] = float(np.median(entry["times_ms"]))
    return result


def markdown(results: list, machine: str) -> str:
    names = list(results[0]["formulations"])
    lines = [f"Per-example kernel gradients of a 3x3 convolution, B = {BATCH}, {machine}: median ms and multiple "
             "of the batch filter gradient (one process, interleaved; see the script's docstring).", "",
             "| map, c_in -> c_out | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in results:
        base = r["formulations"]["filter"]["median_ms"]
        cells = []
        for name in names:
            entry = r["formulations"][name]
            cells.append("error" if "error" in entry else
                         f"{entry['median_ms']:.1f} ({entry['median_ms'] / base:.1f}x)")
        lines.append(f"| {r['size']}x{r['size']}, {r['c_in']} -> {r['c_out']} | " + " | ".join(cells) + " |")
    errors = [f"{r['size']}x{r['size']} {name}: {e['error']}" for r in results
              for name, e in r["formulations"].items() if "error" in e]
    if errors:
        lines += ["", "Refused: " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    machine = f"{os.cpu_count()} CPU cores, TensorFlow {tf.__version__}"
    results = []
    for size, c_in, c_out in SHAPES:
        results.append({"size": size, "c_in": c_in, "c_out": c_out,
                        "formulations": measure(size, c_in, c_out, args.repeats)})
        print(f"{size}x{size} {c_in}->{c_out}: " + ", ".join(
            f"{k} {v.get('median_ms', float('nan')):.1f}" for k, v in results[-1]["formulations"].items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    args.out.with_suffix(".md").write_text(markdown(results, machine))
    print(markdown(results, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
