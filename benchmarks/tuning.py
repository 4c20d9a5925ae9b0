#!/usr/bin/env python
"""Privately tuned headline numbers: ``sparta-tune`` on the standard cifar10-transfer track.

Each cell (method x total epsilon x seed) is one private tuning (:mod:`trainers.tune`): a random number
of candidate runs (a geometric number, mean 3), each drawing its learning rate uniformly from the grid
the standard profile's non-private tuning tried for that method (head rate 10x, as there), the best by
noisy validation accuracy released; the whole procedure, training and selection, within (epsilon, 1e-5).
Everything else is the standard profile's (``benchmarks/utility.py``: the shipped public model, 5,000 +
556 private examples, T = 20 epochs at expected batch 250). Its numbers are set beside the standard
profile's, whose learning rate was chosen non-privately on the same validation split.

The tuning seed of each cell is public (1000 + seed, so the benchmark reproduces; the ledger notes it) and
the benchmark reads the number of candidates from each tuning's private state for the cost table, which a
real user would keep secret. Resumable: each tuning runs (or resumes) in ``--work-dir``; finished ones are
read back from the committed report. A tuning of seed 0 takes longer than a machine is held, so the finished
candidates of the tunings still running are copied to ``--cache-dir`` (committed, :func:`save_cache`) while they
run, and a fresh machine restores them into ``--work-dir`` and resumes there (:func:`restore_cache`). The cache
holds each tuning's private state (its draws, split key and candidates' scores), which a real user keeps with the
data; here the data are public and the tuning seeds already are. Outputs ``benchmarks/results/cifar10-transfer-tuned.{json,md}``, rewritten after every cell,
with the cells still missing named.

    python benchmarks/tuning.py --data-dir ../shared/data --jobs 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import utility  # noqa: E402
from sparta_tf.atomic_files import write_atomic  # noqa: E402
from sparta_tf.tuning.procedure import best_index  # noqa: E402

TRACK, PROFILE = "cifar10-transfer", "standard"
SMOKE = {"methods": ("sparta",), "epsilons": (8.0,), "seeds": (0,), "mean": 1.5, "seed_base": 0}
"""``--smoke`` (CI): the smoke profile's tiny runs, one cell (tuning seed 0 draws one candidate at mean 1.5), so
that the script cannot rot."""
SEED_BASE = 1000
"""A cell's tuning seed: ``SEED_BASE + seed`` (public, so that the benchmark reproduces)."""
METHODS = ("sparta", "all")
EPSILONS = (8.0, 2.0)
SEEDS = (0, 1, 2)
RUN_ORDER = (1, 2, 0)
"""The seeds in the order their cells run: the tuning seeds 1000-1002 draw 7, 1 and 1 candidates per cell (the
same for every method and epsilon), so seeds 1 and 2 (an hour at --jobs 2) run before seed 0 (about 4 hours a
cell here); the report lists the cells in SEEDS order and says which are missing."""
GRIDS = {"sparta": (0.01, 0.03, 0.1, 0.3), "all": (0.01, 0.03, 0.1)}
"""The rates the standard profile's non-private tuning tried (its grid and bracket extension)."""
MEAN, SHAPE = 3, "geometric"
NAME = f"{TRACK}-tuned"
CACHE_DIR = os.path.join(ROOT, "benchmarks", "cache", NAME)
"""Where the finished candidates of unfinished tunings are kept between machines (committed; see the module doc)."""
TUNING_FILES = ("tuning.json", "config.json")
"""A tuning's state (its secret draws and split key, the config it was started with): all ``--resume`` reads."""
CANDIDATE_FILES = ("results.json", "ledger.json", "config.json", "plan.json", "diverged.json")
"""What ``--resume`` reads of a finished candidate (its score and ledger), with its config and plan for the record;
its model (``model.keras``) is kept only while it is the best so far, the one a release could still copy."""
MODEL = "model.keras"
CACHE_INTERVAL_S = 60
"""How often a running tuning's finished candidates are copied to the cache."""


def cell_config(base: dict, method: str, epsilon: float, seed: int, work_dir: str, mean: float = MEAN,
                seed_base: int = SEED_BASE) -> dict:
    config = utility.cell_config(base, method, epsilon, seed, GRIDS[method][0], utility.DEFAULT_DENSITY,
                                 os.path.join(work_dir, f"{method}-eps{epsilon:g}-seed{seed}"))
    config["tuning"] = {"space": [{"training.learning_rate": lr, "training.head_learning_rate": 10 * lr}
                                  for lr in GRIDS[method]], "mean": mean, "shape": SHAPE, "seed": seed_base + seed}
    return config


def finished_candidates(out: str) -> list[str]:
    """The candidate directories of the tuning in ``out`` that finished (with a score or diverged), in order:
    candidates run one after another, so these are a prefix of the draws."""
    with open(os.path.join(out, "tuning.json")) as f:
        total = len(json.load(f)["draws"]["candidates"])
    finished = []
    for index in range(total):
        path = os.path.join(out, "candidates", f"{index:03d}")
        if not any(os.path.exists(os.path.join(path, name)) for name in ("results.json", "diverged.json")):
            break
        finished.append(path)
    return finished


def _score(candidate_dir: str) -> float | None:
    path = os.path.join(candidate_dir, "results.json")
    if not os.path.exists(path):
        return None  # diverged: ranks last
    with open(path) as f:
        return json.load(f)["tuning_score"]


def save_cache(out: str, cache: str) -> int:
    """Copies the tuning in ``out`` (unfinished, with its state) to ``cache``: its state, every finished
    candidate's :data:`CANDIDATE_FILES`, and the model of the best of them only (by the release's own rule,
    :func:`~sparta_tf.tuning.procedure.best_index`: a later candidate must beat it, so no other can be
    released). Returns the number of finished candidates kept."""
    if not os.path.exists(os.path.join(out, "tuning.json")) or os.path.exists(os.path.join(out, "results.json")):
        return 0
    finished = finished_candidates(out)
    best = best_index([_score(path) for path in finished])
    for name in TUNING_FILES:
        _copy(os.path.join(out, name), os.path.join(cache, name))
    for index, path in enumerate(finished):
        kept = os.path.join(cache, "candidates", os.path.basename(path))
        for name in CANDIDATE_FILES + (MODEL,):
            source = os.path.join(path, name)
            if os.path.exists(source) and (name != MODEL or index == best):
                _copy(source, os.path.join(kept, name))
            elif name == MODEL and os.path.exists(os.path.join(kept, name)):
                os.remove(os.path.join(kept, name))  # beaten: it can no longer be released
    return len(finished)


def _copy(source: str, destination: str) -> None:
    """``source`` to ``destination`` unless it is there with the same bytes (atomically: a kill leaves either)."""
    with open(source, "rb") as f:
        content = f.read()
    if os.path.exists(destination):
        with open(destination, "rb") as f:
            if f.read() == content:
                return
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    temporary = destination + ".partial"
    with open(temporary, "wb") as f:
        f.write(content)
    os.replace(temporary, destination)


def restore_cache(out: str, cache: str) -> bool:
    """Copies a cached tuning into ``out`` (which must not exist) so that ``sparta-tune --resume`` continues it
    after its last finished candidate; False when there is nothing cached."""
    if os.path.exists(out) or not os.path.exists(os.path.join(cache, "tuning.json")):
        return False
    shutil.copytree(cache, out)
    print(f"restored {len(finished_candidates(out))} finished candidate(s) of {os.path.basename(out)} from {cache}",
          flush=True)
    return True


def run_tuning(config: dict, cache: str | None = None) -> dict:
    """The tuning's released ``results.json`` (running or resuming it first, from ``cache`` on a fresh machine,
    which it keeps up to date while it runs), with its cost."""
    out = config["output_dir"]
    results_path = os.path.join(out, "results.json")
    if not os.path.exists(results_path):
        if cache:
            restore_cache(out, cache)
        os.makedirs(out, exist_ok=True)
        config_path = os.path.join(out, "..", os.path.basename(out) + ".yaml")
        write_atomic(config_path, json.dumps(config, indent=1))
        resume = ["--resume"] if os.path.exists(os.path.join(out, "tuning.json")) else []
        start = time.time()
        with open(out + ".log", "a") as log:
            process = subprocess.Popen([sys.executable, "-m", "trainers.tune_cli", "--config", config_path, *resume],
                                       cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            while True:
                try:
                    returncode = process.wait(timeout=CACHE_INTERVAL_S)
                    break
                except subprocess.TimeoutExpired:
                    if cache:
                        save_cache(out, cache)
        if returncode:
            if cache:
                save_cache(out, cache)
            raise RuntimeError(f"sparta-tune failed for {out} (exit {returncode}); see {out}.log")
        print(f"tuned {os.path.basename(out)} in {time.time() - start:.0f} s", flush=True)
    with open(results_path) as f:
        results = json.load(f)
    results |= results.pop("not_released", {})  # the tuning's private side: the winner's test accuracy
    results.pop("release_dir", None)
    with open(os.path.join(out, "tuning.json")) as f:
        state = json.load(f)
    seconds = []
    for index in range(len(state["draws"]["candidates"])):
        with open(os.path.join(out, "candidates", f"{index:03d}", "results.json")) as f:
            candidate = json.load(f)
        seconds.append(candidate.get("prepare_s", 0) + candidate.get("train_s", 0))
    return results | {"candidates": len(state["draws"]["candidates"]), "candidate_seconds": seconds}


def today(method: str, epsilon: float, profile: str = PROFILE, seeds=SEEDS) -> dict[int, float]:
    """Seed -> the profile's test accuracy (of ``seeds``, rate tuned non-privately) at ``epsilon``."""
    path = os.path.join(ROOT, "benchmarks", "results", f"{TRACK}-{profile}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        runs = json.load(f)["runs"]
    return {r["seed"]: r["test_accuracy"] for r in runs if r["method"] == method and r["target_epsilon"] == epsilon
            and r["kind"] == "main" and r["seed"] in seeds}


def paired(tuned: dict[int, float], untuned: dict[int, float]) -> str:
    """Tuned minus today's on the seeds both have, in points: mean [95% t-interval] (n)."""
    from scipy import stats

    differences = [100 * (tuned[s] - untuned[s]) for s in sorted(tuned) if s in untuned]
    if not differences:
        return "-"
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return f"{mean:+.2f} (n = 1)"
    half = stats.t.ppf(0.975, len(differences) - 1) * statistics.stdev(differences) / math.sqrt(len(differences))
    return f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}] (n = {len(differences)})"


def untuned_noise(method: str, epsilon: float, profile_name: str = PROFILE) -> float | None:
    """The noise multiplier of one untuned run of ``method`` at ``epsilon`` on the profile (PLD, as the
    standard profile's runs were calibrated), for the price of tuning; None when it cannot be planned."""
    from sparta_tf.data.splits import fraction_count
    from sparta_tf.methods import make_method
    from sparta_tf.private_training import plan_method
    from trainers.config import validate

    profile = utility.PROFILES[profile_name]
    base = {"data": {"source": "digits"}, "model": {"name": "resnet20_gn"}, "privacy": {},  # only the method matters
            "training": {"epochs": profile["epochs"], "batch_size": profile["batch_size"]}}
    config = validate(utility.cell_config(base, method, epsilon, 0, 0.1, utility.DEFAULT_DENSITY, "unused"))
    options = {k: v for k, v in config["method"].items() if k != "name"}
    n = profile["limit_train"] - fraction_count(profile["limit_train"], 0.1)  # the pinned positions split's train size
    try:
        return plan_method(make_method(method, **options), dataset_size=n, batch_size=profile["batch_size"],
                           epochs=profile["epochs"], delta=utility.DELTA, target_epsilon=epsilon).noise_multiplier
    except (ValueError, SystemExit):
        return None


def interval(values: list[float]) -> str:
    """``mean ± half-width`` of the 95% t-interval (n - 1 degrees of freedom); the mean alone for n = 1."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.4f} (n = 1)"
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.4f} ± {half:.4f} (n = {len(values)})"


def progress(config: dict) -> str:
    """An unfinished tuning's progress: its finished candidates of its total (read from its private state)."""
    out = config["output_dir"]
    try:
        with open(os.path.join(out, "tuning.json")) as f:
            total = len(json.load(f)["draws"]["candidates"])
    except OSError:
        return "not started"
    done = sum(os.path.exists(os.path.join(out, "candidates", f"{i:03d}", "results.json")) for i in range(total))
    return f"{done} of {total} candidates done"


def report(records: list[dict], missing: list[str], out_dir: str, name: str = NAME, mean: float = MEAN,
           profile: str = PROFILE) -> None:
    write_atomic(os.path.join(out_dir, f"{name}.json"),
                 json.dumps({"mean": MEAN, "shape": SHAPE, "grids": GRIDS, "runs": records, "missing": missing},
                            indent=1))
    lines = [f"# {TRACK}: privately tuned (sparta-tune) vs today's non-privately tuned rate", "",
             f"Each privately tuned number: a {SHAPE} number of candidates (mean {mean:g}), each drawing its rate "
             "from the method's grid, the best by noisy validation accuracy released; training and selection "
             "within the total epsilon (delta 1e-5). Today's: the standard profile's runs at the rate chosen "
             "non-privately at epsilon 2 on the same validation split (the " + profile + " profile). 95% t-intervals "
             "over seeds.", "",
             "Run (resumes, on a fresh machine from the committed cache of unfinished tunings): `python "
             "benchmarks/tuning.py --data-dir ../shared/data --jobs 2`; the tuning seeds are "
             "public (1000 + seed) so that the benchmark reproduces, which the released ledgers note.", "",
             "| method | epsilon | privately tuned (covered) | today's rate (not covered) | tuned − today, paired "
             "(points) | rates released | noise: each candidate / one untuned run | per-run epsilon | candidates "
             "(total) | CPU-hours |", "|---|---|---|---|---|---|---|---|---|---|"]
    for method in METHODS:
        for epsilon in EPSILONS:
            mine = [r for r in records if r["method"] == method and r["target_epsilon"] == epsilon]
            if not mine:
                continue
            released = {r["seed"]: r["test_accuracy"] for r in mine if r.get("released")}
            accuracies = list(released.values())
            rates = [r["hyperparameters"]["training.learning_rate"] for r in mine if r.get("released")]
            hours = sum(sum(r["candidate_seconds"]) for r in mine) / 3600
            previous = today(method, epsilon, profile)
            sigma, untuned = mine[0]["noise_multiplier"], untuned_noise(method, epsilon, profile)
            noise = f"{sigma:.3g} / {untuned:.3g} ({sigma / untuned:.2f}x)" if untuned else f"{sigma:.3g}"
            lines.append(f"| {method} | {epsilon:g} | {interval(accuracies) if accuracies else '-'} | "
                         f"{interval(list(previous.values())) if previous else '-'} | {paired(released, previous)} | "
                         f"{rates} | {noise} | {mine[0]['per_run_epsilon']:.3g} | "
                         f"{sum(r['candidates'] for r in mine)} | {hours:.1f} |")
    total = sum(sum(r["candidate_seconds"]) for r in records) / 3600
    lines += ["", f"Cost so far: {sum(r['candidates'] for r in records)} candidate runs, {total:.1f} CPU-hours "
              "(each run's preparation + training wall time, about one core each)."]
    if missing:
        lines += ["", f"Missing (resumable with the command above): {'; '.join(missing)}."]
    write_atomic(os.path.join(out_dir, f"{name}.md"), "\n".join(lines) + "\n")


def committed_records(out_dir: str, name: str, cells: list, configs: dict) -> dict:
    """The finished tunings of the committed report whose directory is gone (another machine): kept, not run
    again. A tuning whose directory exists is read (or resumed) there instead."""
    path = os.path.join(out_dir, f"{name}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        runs = json.load(f)["runs"]
    kept = {}
    for run in runs:
        cell = (run["method"], run["target_epsilon"], run["seed"])
        if cell in configs and not os.path.exists(configs[cell]["output_dir"]):
            kept[cell] = run
    return kept


def cell_cache(cache_dir: str, config: dict) -> str:
    return os.path.join(cache_dir, os.path.basename(config["output_dir"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "..", "shared", "data"))
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "tuning", NAME))
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--cache-dir", help="where the finished candidates of unfinished tunings are kept between "
                        f"machines (default {os.path.relpath(CACHE_DIR, ROOT)}, committed: a fresh machine resumes "
                        "from it; with --smoke, under --work-dir)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--report", action="store_true", help="rewrite the report from the finished tunings and "
                        "the progress of the others; run nothing")
    parser.add_argument("--smoke", action="store_true", help="one tiny cell on the smoke profile's sizes (CI)")
    args = parser.parse_args(argv)
    profile = utility.PROFILES["smoke" if args.smoke else PROFILE]
    args.data_dir, args.work_dir = os.path.abspath(args.data_dir), os.path.abspath(args.work_dir)  # a tuning's state
    # records its data's path, which a resume on another machine (or checkout) must find the same
    if args.cache_dir is None:
        args.cache_dir = os.path.join(args.work_dir, "cache") if args.smoke else CACHE_DIR
    base = utility.base_config(TRACK, profile, args.data_dir, "", args.work_dir)
    methods, epsilons, seeds = (SMOKE["methods"], SMOKE["epsilons"], SMOKE["seeds"]) if args.smoke else \
        (METHODS, EPSILONS, SEEDS)
    name = f"{TRACK}-tuned-smoke" if args.smoke else NAME
    cells = [(m, e, s) for s in sorted(seeds, key=lambda s: RUN_ORDER.index(s) if s in RUN_ORDER else s)
             for e in epsilons for m in methods]
    mean = SMOKE["mean"] if args.smoke else MEAN
    seed_base = SMOKE["seed_base"] if args.smoke else SEED_BASE
    profile_name = "smoke" if args.smoke else PROFILE
    configs = {cell: cell_config(copy.deepcopy(base), *cell, args.work_dir, mean, seed_base) for cell in cells}
    records = committed_records(args.out_dir, name, cells, configs)
    names = {cell: f"{cell[0]} eps {cell[1]:g} seed {cell[2]} ({progress(configs[cell])})" for cell in cells}
    if args.report:
        for cell in cells:
            if cell not in records and os.path.exists(os.path.join(configs[cell]["output_dir"], "results.json")):
                records[cell] = {"method": cell[0], "target_epsilon": cell[1], "seed": cell[2],
                                 **run_tuning(configs[cell])}
        report([records[c] for c in cells if c in records], [names[c] for c in cells if c not in records],
               args.out_dir, name, mean, profile_name)
        return 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_tuning, configs[cell], cell_cache(args.cache_dir, configs[cell])): cell
                   for cell in cells if cell not in records}
        for future in concurrent.futures.as_completed(futures):
            cell = futures[future]
            records[cell] = {"method": cell[0], "target_epsilon": cell[1], "seed": cell[2], **future.result()}
            shutil.rmtree(cell_cache(args.cache_dir, configs[cell]), ignore_errors=True)  # the report holds it now
            ordered = [records[c] for c in cells if c in records]
            report(ordered, [names[c] for c in cells if c not in records], args.out_dir, name, mean, profile_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
