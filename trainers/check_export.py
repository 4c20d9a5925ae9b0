"""``sparta-check-export --config CONFIG [--set ...] [--export DIR]``: does the served model reproduce the run?

A finished ``sparta-train`` run records its test accuracy in ``results.json``
and writes a TF-Serving SavedModel to ``export/<version>/``. This check

1. loads the run's test split in the scale the serving signature takes:
   the config's data with normalisation switched off (the export bakes the
   run's ``(x - mean) / std`` in front of the model, so clients send the
   images as they are, e.g. ``[0, 1]`` floats);
2. evaluates the SavedModel in a fresh Python process that cannot import
   ``sparta_tf`` or ``trainers`` (TensorFlow and NumPy only, as TF Serving
   would run it);
3. passes when every probability is finite, every row sums to 1 (to
   ``1e-4``) and the served accuracy is within ``0.5`` points of the run's
   ``test_accuracy``.

Exit status 0 when the check passes, 1 when it fails, 2 for a bad config, 130 after
Ctrl-C (one line; the check writes nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from trainers.config import ConfigError, load_config
from trainers.interrupt import stop_on_ctrl_c
from trainers.quiet import import_tensorflow

ACCURACY_TOLERANCE = 0.005  # 0.5 points
SUM_TOLERANCE = 1e-4

# Runs in a fresh interpreter in which sparta_tf and trainers cannot be imported.
SERVE_SCRIPT = """
import sys
sys.modules["sparta_tf"] = None
sys.modules["trainers"] = None
import numpy as np, tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
images = np.load(sys.argv[2])
batches = [serve(images=tf.constant(images[i:i + 512]))["probabilities"].numpy()
           for i in range(0, len(images), 512)]
np.save(sys.argv[3], np.concatenate(batches) if batches else np.zeros((0, 0), np.float32))
"""


@dataclasses.dataclass
class ExportCheck:
    """What the served model did on the run's test images."""

    export_dir: str
    examples: int
    served_accuracy: float
    run_accuracy: float
    finite: bool
    max_sum_error: float

    @property
    def passed(self) -> bool:
        return (self.finite and self.max_sum_error <= SUM_TOLERANCE
                and abs(self.served_accuracy - self.run_accuracy) <= ACCURACY_TOLERANCE)

    def describe(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (f"export check {verdict}: {self.export_dir} on {self.examples} test images: "
                f"accuracy {self.served_accuracy:.4f} (run: {self.run_accuracy:.4f}, tolerance "
                f"{ACCURACY_TOLERANCE:.3f}); probabilities {'finite' if self.finite else 'NOT finite'}, "
                f"max |row sum - 1| = {self.max_sum_error:.2e}")


def serve_in_fresh_process(export_dir: str, images: np.ndarray, timeout: float = 600) -> np.ndarray:
    """``probabilities`` of ``export_dir``'s ``serving_default`` for ``images``, computed without sparta_tf."""
    with tempfile.TemporaryDirectory() as scratch:
        inputs, outputs = os.path.join(scratch, "images.npy"), os.path.join(scratch, "probabilities.npy")
        np.save(inputs, np.asarray(images, np.float32))
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run([sys.executable, "-c", SERVE_SCRIPT, export_dir, inputs, outputs],
                                env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"serving {export_dir} in a fresh process failed: {last}")
        return np.load(outputs)


def raw_test_split(config: dict) -> tuple[np.ndarray, np.ndarray]:
    """The run's test images and labels before normalisation (what a serving client sends)."""
    import_tensorflow()
    from sparta_tf.data import load_dataset

    from trainers.split_key import stored_split_key

    spec = {k: v for k, v in config["data"].items() if k not in ("normalize", "mean", "std")}
    seed = config["training"]["seed"]
    dataset = load_dataset(spec, seed=0 if seed is None else seed,
                           split_key=stored_split_key(config["output_dir"], config))
    return dataset.x_test, dataset.y_test


def finished_run(output_dir: str) -> dict:
    """``results.json`` of a finished run, or a ConfigError saying how to make one."""
    path = os.path.join(output_dir, "results.json")
    if not os.path.exists(path):
        raise ConfigError(f"no finished run in {output_dir} (no results.json); run sparta-train with "
                          "this config first")
    try:
        with open(path, "rb") as f:
            results = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        where = f" at char {error.pos}" if isinstance(error, json.JSONDecodeError) else ""
        raise ConfigError(f"{path} is not a complete results.json (not JSON{where}: the run did not finish "
                          "writing it); run sparta-train again with a new output_dir") from None
    if not isinstance(results, dict) or "test_accuracy" not in results:
        raise ConfigError(f"{path} is not a results.json written by sparta-train (no test_accuracy); run "
                          "sparta-train again with a new output_dir")
    if not results.get("export_dir"):
        raise ConfigError(f"the run in {output_dir} exported nothing (export.enabled was false)")
    return results


def check_export(config: dict, export_dir: str | None = None) -> ExportCheck:
    """Serves the run's export on its test images in a fresh process; see the module doc."""
    results = finished_run(config["output_dir"])
    export_dir = export_dir or results["export_dir"]
    images, labels = raw_test_split(config)
    probabilities = serve_in_fresh_process(export_dir, images)
    finite = bool(np.all(np.isfinite(probabilities)))
    sums = np.abs(probabilities.sum(axis=-1) - 1.0) if len(probabilities) else np.zeros(1)
    return ExportCheck(
        export_dir=export_dir,
        examples=len(labels),
        served_accuracy=float(np.mean(probabilities.argmax(axis=-1) == labels)) if finite else 0.0,
        run_accuracy=float(results["test_accuracy"]),
        finite=finite,
        max_sum_error=float(np.nanmax(sums)) if finite else float("inf"),
    )


def _data_error() -> type:
    from sparta_tf.data import DataError

    return DataError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sparta-check-export", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the config the run was made with")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="the same --set overrides the run was made with")
    parser.add_argument("--export", help="a SavedModel version directory (default: the run's export_dir)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return stop_on_ctrl_c(lambda: _check(args), lambda: INTERRUPTED_LINE)


INTERRUPTED_LINE = ("interrupted: the export check stopped (Ctrl-C) before its verdict; it wrote nothing (its scratch "
                    "files are removed): run the same command again to check the export")
"""What Ctrl-C prints: the check only reads the run and the export (the serving process is stopped too)."""


def _check(args: argparse.Namespace) -> int:
    try:
        check = check_export(load_config(args.config, args.overrides), args.export)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, _data_error()) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(check.describe())
    return 0 if check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
