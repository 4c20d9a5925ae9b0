#!/usr/bin/env python
"""User-level against example-level DP on the standard cifar10-transfer track (issue 63).

The standard profile's private data (CIFAR-10 classes 5-9, 5,000 training and 2,000 test images, the
shipped public model pre-trained on classes 0-4; ``benchmarks/utility.py``) given synthetic users: user
sizes are drawn i.i.d. from a truncated power law, ``P(size = s) ∝ s^-1.2`` for ``s`` in 1..20 (mean
about 5.5: many people with a few images, a few with many), and the training images are dealt to users
in a random order (seed 0). The test split is the track's own (no user is in both). Both units train on
exactly these 5,000 images (``data.val_fraction: 0``: a validation split would hold out examples at
example level and users at user level, two different training sets).

Cells: ``--methods`` (sparta, all) x unit (example, user) x ``--seeds`` (0-2) at epsilon 8, the standard
profile's recipe (20 epochs, cosine schedule, its learning rates: sparta 0.1, all 0.03, head 10x). The
expected batch is q n with q = 250 / 5000 at both units: 250 examples, or q U users (each bringing at most
``k`` of their images, the dry run's default ``k``). Reported: test accuracy per cell, the paired
difference user - example per method (mean over seeds with a 95% t interval), minutes per run, and what
the example-level epsilon leaves a person with the median and the largest number of images (group
privacy, :mod:`sparta_tf.privacy.group_privacy`).

Resumable: a cell whose ``results.json`` exists in ``--work-dir`` is not run again; the report is rewritten
after every cell (what is missing is listed).

    python benchmarks/user_level.py --data-dir ../shared/data               # ~3 CPU-hours
    python benchmarks/user_level.py --smoke --methods all --seeds 0 --data-dir ../shared/data \
        --work-dir /tmp/u --out-dir /tmp/u                                  # CI smoke, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import utility  # noqa: E402
import utility_report  # noqa: E402
from sparta_tf.atomic_files import write_atomic  # noqa: E402

TRACK = "cifar10-transfer"
EPSILON = 8.0
RATES = {"sparta": 0.1, "all": 0.03}  # the standard profile's rates (tuned at eps 2 on its grid)
POWER, LARGEST = 1.2, 20
UNITS = ("example", "user")
USER_KEY = "user"


def user_sizes(examples: int, seed: int = 0) -> np.ndarray:
    """Sizes from ``P(s) ∝ s^-POWER`` on 1..LARGEST, drawn until they cover ``examples`` (the last one cut)."""
    rng = np.random.default_rng(seed)
    support = np.arange(1, LARGEST + 1)
    law = support ** -POWER / np.sum(support ** -POWER)
    sizes = []
    while sum(sizes) < examples:
        sizes.append(int(rng.choice(support, p=law)))
    sizes[-1] -= sum(sizes) - examples
    return np.array(sizes)


def write_user_data(data_dir: str, out: str, profile: dict, seed: int = 0) -> dict:
    """The track's private split with synthetic users, as an npz; returns its ``data:`` spec (no users
    key: the user-level cells add it)."""
    from sparta_tf.data import load_dataset

    base = utility.base_config(TRACK, profile, data_dir, "", os.path.dirname(out))
    data = load_dataset(base["data"], seed=0)
    sizes = user_sizes(len(data.y_train), seed)
    users = np.random.default_rng(seed + 1).permutation(np.repeat(np.arange(len(sizes)), sizes))
    np.savez(out, x_train=data.x_train, y_train=data.y_train, x_test=data.x_test, y_test=data.y_test,
             **{f"{USER_KEY}_train": users}, class_names=np.array(data.class_names))
    return {"source": "npz", "path": out, "val_fraction": 0.0}


def cell_config(base: dict, data: dict, cell: tuple[str, str, int], sizes: np.ndarray, out: str) -> dict:
    """The config of ``cell = (method, unit, seed)``: the standard profile's, on the users' data; at user level
    the expected batch is ``q U`` users for the example level's ``q = batch / n``."""
    method, unit, seed = cell
    config = utility.cell_config(base, method, EPSILON, seed, RATES[method], utility.DEFAULT_DENSITY, out)
    config["data"] = dict(data) | ({"user_key": USER_KEY} if unit == "user" else {})
    if unit == "user":
        q = config["training"]["batch_size"] / int(sizes.sum())
        config["privacy"]["unit"] = "user"
        config["training"]["batch_size"] = max(1, round(q * len(sizes)))
    return config


def run_cell(config: dict) -> dict:
    from sparta_tf import checkpointing
    from trainers import run
    from trainers.config import validate

    # a run killed after its first checkpoint resumes there (bit-identical to an uninterrupted run); its
    # minutes then count only the resumed part
    resume = bool(checkpointing.has_state(config["output_dir"]))
    start = time.perf_counter()
    results = run.train(validate(config), resume=resume)
    return {"test_accuracy": results["test_accuracy"], "epsilon": results["epsilon"], "n": results["n"],
            "examples_per_user": results.get("examples_per_user"), "minutes": (time.perf_counter() - start) / 60,
            **({"resumed": True} if resume else {})}  # its interrupted steps charged again: it may stop early


def report(results: dict, methods, seeds, sizes: np.ndarray) -> str:
    """Markdown: accuracy per method and unit, the paired difference, the cost, what is missing, and the
    example-level guarantee for a person."""
    from sparta_tf.privacy.group_privacy import describe_group_guarantee

    lines = ["| method | example level (%) | user level (%) | user − example (points, 95% CI) | min / run |",
             "|---|---:|---:|---:|---:|"]
    missing = []
    for method in methods:
        runs = [{"method": unit, "target_epsilon": EPSILON, "seed": seed, **results[f"{method}-{unit}-seed{seed}"]}
                for unit in UNITS for seed in seeds if f"{method}-{unit}-seed{seed}" in results]
        missing += [f"{method}-{unit}-seed{seed}" for unit in UNITS for seed in seeds
                    if f"{method}-{unit}-seed{seed}" not in results]
        if not runs:
            lines.append(f"| {method} | — | — | — | — |")
            continue
        accuracy = {unit: [100 * r["test_accuracy"] for r in runs if r["method"] == unit] for unit in UNITS}
        difference = utility_report.paired_differences(runs, reference="user").get(("example", EPSILON))
        lines.append(f"| {method} | {_mean_std(accuracy['example'])} | {_mean_std(accuracy['user'])} "
                     f"| {'—' if difference is None else utility_report.format_difference(difference)} "
                     f"| {statistics.median(r['minutes'] for r in runs):.0f} |")
    median, largest = int(np.median(sizes)), int(sizes.max())
    lines += ["", f"Users: {len(sizes)} for {int(sizes.sum())} training images (per user: median {median}, "
              f"largest {largest}). For comparison, " + describe_group_guarantee(EPSILON, utility.DELTA, median)
              + "; for the largest, " + describe_group_guarantee(EPSILON, utility.DELTA, largest).split("which ")[-1]
              + "."]
    if missing:
        lines += ["", f"Missing ({len(missing)} runs): " + ", ".join(missing)]
    return "\n".join(lines) + "\n"


def _mean_std(values) -> str:
    if not values:
        return "—"
    return f"{statistics.mean(values):.2f}" + (f" ± {statistics.stdev(values):.2f} ({len(values)})"
                                              if len(values) > 1 else " (1)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "..", "shared", "data"))
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "user-level-bench"))
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--methods", nargs="+", default=["sparta", "all"], choices=sorted(RATES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--smoke", action="store_true", help="seconds-scale sizes (CI: the script must not rot)")
    args = parser.parse_args(argv)
    profile = utility.PROFILES["smoke" if args.smoke else "standard"]
    os.makedirs(args.work_dir, exist_ok=True)
    data = write_user_data(args.data_dir, os.path.join(args.work_dir, "users.npz"), profile)
    with np.load(data["path"]) as npz:
        users = npz[f"{USER_KEY}_train"]
    sizes = np.bincount(users)
    base = utility.base_config(TRACK, profile, args.data_dir, "", args.work_dir)
    stem = os.path.join(args.out_dir, f"{TRACK}-user-level" + ("-smoke" if args.smoke else ""))
    results = json.load(open(stem + ".json")) if os.path.exists(stem + ".json") else {}
    for seed in args.seeds:
        for method in args.methods:
            for unit in UNITS:
                key = f"{method}-{unit}-seed{seed}"
                if key in results:
                    continue
                config = cell_config(base, data, (method, unit, seed), sizes, os.path.join(args.work_dir, key))
                print(f"== {key}", flush=True)
                results[key] = run_cell(config)
                write_atomic(stem + ".json", json.dumps(results, indent=1))
                write_atomic(stem + ".md", report(results, args.methods, args.seeds, sizes))
    print(report(results, args.methods, args.seeds, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
