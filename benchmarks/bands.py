#!/usr/bin/env python
"""Correlated noise (BandMF) against DP-SGD on the standard cifar10-transfer track (issue 62).

Everything is the standard profile's (``benchmarks/utility.py``: the shipped public model, 5,000 + 556
private examples, T = 20 epochs at expected batch 250, cosine schedule, momentum 0.9, delta 1e-5) except
``privacy.bands``:

1. **Bands, chosen before any run**: for each method and epsilon, the number of bands whose noise on the
   final weights is the smallest in the dry run's comparison (:func:`trainers.run.bands_comparison`: each
   b with its own sigma calibrated to the epsilon, the banded square root of the momentum workload;
   ``b`` up to ``1 / q``). No accuracy is looked at.
2. **The learning rate, re-bracketed as the standard profile did**: at epsilon 2 and seed 0, with that
   epsilon's bands, rates from today's (sparta 0.1, all 0.03) to their neighbours on the ladder
   0.003 ... 1 until the best by validation accuracy has a worse rate on both sides (head rate 10x). The
   chosen rate is used at every epsilon, as the standard profile's is (chosen outside the guarantee, as
   theirs was: the comparison is like for like).
3. **Main cells**: sparta and all at epsilon 8 and 2, seeds 0-4, paired with the standard profile's runs
   of the same seed (independent noise at the rate it chose); 95% t-intervals over the seeds.
4. **Controls, where the bracket moved the rate**: DP-SGD (one band) at BandMF's rate for every main cell, so
   that BandMF − control is the mechanism alone, the rate held fixed (step 3's difference mixes the two).
   A standard-profile run of that rate, epsilon and seed is reused. They run in a chain of their own, beside
   the methods' chains.

Resumable across machines: every finished run is recorded in ``--out-dir``'s JSON (committed) and not run
again; the report is rewritten after each run, with what is missing. A run takes 26-60 minutes on one
core here; all of it about 25 runs and, where the bracket moved the rate, 10 controls (fewer where the
standard profile ran that rate), 20 CPU-hours.

    python benchmarks/bands.py --data-dir ../shared/data --jobs 2   # both methods side by side
    python benchmarks/bands.py --data-dir ../shared/data --bands-only   # step 1 alone: the bands, seconds
    python benchmarks/bands.py --smoke --data-dir ../shared/data --work-dir /tmp/b --out-dir /tmp/b   # CI
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tuning  # noqa: E402  (its paired differences and intervals)
import utility  # noqa: E402
from sparta_tf.atomic_files import write_atomic  # noqa: E402

TRACK, PROFILE = "cifar10-transfer", "standard"
NAME = f"{TRACK}-bands"
METHODS = ("sparta", "all")
EPSILONS = (8.0, 2.0)
SEEDS = (0, 1, 2, 3, 4)
TUNE_EPSILON, TUNE_SEED = 2.0, 0
LADDER = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
TODAY = {"sparta": 0.1, "all": 0.03}
"""The standard profile's rates (chosen at epsilon 2 on its validation split): where the bracket starts."""
CONTROLS = "controls"
"""The name of the controls' chain (DP-SGD at BandMF's rate), run beside the methods' chains."""
SMOKE = {"methods": ("sparta",), "epsilons": (8.0,), "seeds": (0,)}


def with_bands(config: dict, bands: int) -> dict:
    return dict(config, privacy=dict(config["privacy"], bands=bands))


def chosen_bands(base: dict, method: str, epsilon: float, work_dir: str) -> tuple[int, list[dict]]:
    """The bands that minimise the dry run's final-weights noise for ``method`` at ``epsilon``, and the
    comparison it came from."""
    from trainers import run
    from trainers.config import validate

    config = validate(utility.cell_config(base, method, epsilon, 0, TODAY[method], utility.DEFAULT_DENSITY,
                                          os.path.join(work_dir, "dry-run")))
    errors = run.planned_bands_comparison(config)
    best = min(errors, key=lambda e: e.ratio)
    return best.bands, [{"bands": e.bands, "noise_multiplier": e.noise_multiplier, "ratio": e.ratio} for e in errors]


def run_record(base: dict, method: str, epsilon: float, seed: int, rate: float, bands: int, work_dir: str,
               kind: str) -> dict:
    """One run (:func:`utility.run_cell`), as the report records it."""
    out = os.path.join(work_dir, f"{kind}-{method}-eps{epsilon:g}-seed{seed}-lr{rate:g}-b{bands}")
    config = with_bands(utility.cell_config(base, method, epsilon, seed, rate, utility.DEFAULT_DENSITY, out), bands)
    results = utility.run_cell(config, method)
    return {"kind": kind, "method": method, "target_epsilon": epsilon, "seed": seed, "learning_rate": rate,
            "bands": bands, "epsilon": results.get("epsilon"), "noise_multiplier": results.get("noise_multiplier"),
            "test_accuracy": results["test_accuracy"], "val_accuracy": utility._val_accuracy(results),
            "minutes": results["wall_s"] / 60}


def side_by_side(methods, jobs: int, chain, prepare: tuple = ()) -> None:
    """``chain(name, call)`` for every name of ``methods`` (the methods, then any other chain): one after
    another in this process (``jobs`` 1), else up to ``jobs`` chains at once, in order, each
    ``call(function, *args)`` run in one of ``min(jobs, len(methods))`` spawned workers (TensorFlow imported
    once per worker), after ``prepare`` (``(function, *args)``, e.g. pre-training the public model once,
    before workers would race to build its cache) ran in one."""
    if jobs == 1:
        for method in methods:
            chain(method, lambda function, *args: function(*args))
        return
    import concurrent.futures
    import multiprocessing

    workers = min(jobs, len(methods))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=utility.exit_with_parent,
                                                initargs=(os.getpid(),)) as pool:
        if prepare:
            pool.submit(*prepare).result()
        with concurrent.futures.ThreadPoolExecutor(workers) as threads:
            chains = [threads.submit(chain, method, lambda function, *args: pool.submit(function, *args).result())
                      for method in methods]
            for finished in concurrent.futures.as_completed(chains):
                finished.result()  # a failed run stops the benchmark with its error


def best_rate(tried: dict[float, float]) -> float:
    """The rate of the best validation accuracy in ``tried`` (rate -> accuracy); ties go to the smaller rate."""
    return max(tried, key=lambda r: (tried[r], -r))


def tried_rates(state: dict, method: str) -> dict[float, float]:
    """``method``'s bracket so far: rate -> validation accuracy."""
    return {r["learning_rate"]: r["val_accuracy"] for r in state["runs"] if r["kind"] == "tune" and
            r["method"] == method}


def next_rate(tried: dict[float, float]) -> float | None:
    """The next rate of the bracket search: a neighbour on the ladder of the best rate so far that has not
    run; None once the best has run neighbours on both sides (or the ladder's end)."""
    index = LADDER.index(best_rate(tried))
    for neighbour in (index - 1, index + 1):
        if 0 <= neighbour < len(LADDER) and LADDER[neighbour] not in tried:
            return LADDER[neighbour]
    return None


def bracket_choice(state: dict, method: str) -> float | None:
    """The rate ``method``'s finished bracket chose (best validation accuracy, ties to the smaller rate), or
    None while it is unfinished."""
    tried = tried_rates(state, method)
    if not tried or next_rate(tried) is not None:
        return None
    return best_rate(tried)


STANDARD_RESULTS = os.path.join(ROOT, "benchmarks", "results", f"{TRACK}-{PROFILE}.json")


def standard_run(method: str, epsilon: float, seed: int, rate: float, path: str = STANDARD_RESULTS) -> dict | None:
    """The standard profile's DP-SGD run of ``method`` at ``epsilon``, ``seed`` and ``rate`` (a main cell or a
    bracket's run: the same configuration), or None."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        runs = json.load(f)["runs"]
    matching = [r for r in runs if (r["method"], r["target_epsilon"], r["seed"], r["learning_rate"]) ==
                (method, epsilon, seed, rate) and r.get("density", utility.DEFAULT_DENSITY) == utility.DEFAULT_DENSITY]
    return min(matching, key=lambda r: r["kind"] != "main", default=None)


def control_table(state: dict, methods, epsilons, seeds) -> list[str]:
    """Markdown lines: BandMF against DP-SGD at BandMF's rate (the controls), paired by seed; none without
    controls."""
    lines = []
    for method in methods:
        for epsilon in epsilons:
            def accuracies(kind):
                return {r["seed"]: r["test_accuracy"] for r in state["runs"] if r["kind"] == kind and
                        r["method"] == method and r["target_epsilon"] == epsilon and r["seed"] in seeds}
            banded, control = accuracies("main"), accuracies("control")
            if not control:
                continue
            rate = next(r["learning_rate"] for r in state["runs"] if r["kind"] == "control" and r["method"] == method)
            lines.append(f"| {method} | {epsilon:g} | {rate:g} | {tuning.interval(list(control.values()))} "
                         f"| {tuning.paired(banded, control)} |")
    if not lines:
        return []
    return ["", "The mechanism alone, the rate held fixed: DP-SGD (one band) at BandMF's rate, where the bracket "
            "moved it.", "", "| method | ε | rate | DP-SGD at this rate | BandMF − DP-SGD, paired (points) |",
            "|" + "---|" * 5] + lines


def report(state: dict, methods, epsilons, seeds, tune_epsilon: float = TUNE_EPSILON) -> str:
    """Markdown: per method and epsilon, the bands and their predicted noise, BandMF against today's
    DP-SGD paired by seed, the rate, the cost; then the bracket and what is missing."""
    today_runs = {(m, e): tuning.today(m, e, seeds=seeds) for m in methods for e in epsilons}
    lines = ["| method | ε | bands (final-weights noise vs DP-SGD, predicted) | rate | BandMF test accuracy "
             "| DP-SGD today (same seeds) | BandMF − DP-SGD, paired (points) | min / run |", "|" + "---|" * 8]
    missing = []
    for method in methods:
        for epsilon in epsilons:
            key = f"{method}-eps{epsilon:g}"
            choice = state["bands"].get(key)
            runs = {r["seed"]: r for r in state["runs"] if r["kind"] == "main" and r["method"] == method
                    and r["target_epsilon"] == epsilon}
            missing += [f"{method} eps {epsilon:g} seed {s}" for s in seeds if s not in runs]
            if choice is None or not runs:
                lines.append(f"| {method} | {epsilon:g} | {'—' if choice is None else choice['bands']} | — | — | — | — "
                             "| — |")
                continue
            ratio = next(e["ratio"] for e in choice["comparison"] if e["bands"] == choice["bands"])
            mine = {s: r["test_accuracy"] for s, r in runs.items()}
            previous = {s: a for s, a in today_runs[(method, epsilon)].items() if s in mine}
            rate = next(iter(runs.values()))["learning_rate"]
            lines.append(f"| {method} | {epsilon:g} | {choice['bands']} ({ratio:.3f}) | {rate:g} "
                         f"| {tuning.interval(list(mine.values()))} "
                         f"| {tuning.interval(list(previous.values())) if previous else '—'} "
                         f"| {tuning.paired(mine, previous)} "
                         f"| {statistics.median(r['minutes'] for r in runs.values()):.0f} |")
    lines += control_table(state, methods, epsilons, seeds)
    for method in methods:
        rate = bracket_choice(state, method)
        if rate is not None and rate != TODAY[method]:
            missing += [f"control {method} eps {epsilon:g} seed {seed}" for seed in seeds for epsilon in epsilons
                        if not any((r["kind"], r["method"], r["target_epsilon"], r["seed"]) ==
                                   ("control", method, epsilon, seed) for r in state["runs"])]
    bracket = [r for r in state["runs"] if r["kind"] == "tune"]
    if bracket:
        lines += ["", f"Rates tried at epsilon {tune_epsilon:g}, seed {TUNE_SEED} (validation accuracy): " + "; ".join(
            f"{m}: " + ", ".join(f"{r['learning_rate']:g} {r['val_accuracy']:.4f}"
                                 for r in sorted(bracket, key=lambda r: r["learning_rate"]) if r["method"] == m)
            for m in methods if any(r["method"] == m for r in bracket))]
    ran = [r for r in state["runs"] if not r.get("reused")]
    hours = sum(r["minutes"] for r in ran) / 60
    lines += ["", f"Cost so far: {len(ran)} runs, {hours:.1f} CPU-hours (wall time, about one core each)."]
    if missing:
        lines += ["", f"Missing ({len(missing)} runs, resumable): " + "; ".join(missing) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "..", "shared", "data"))
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bands-bench"))
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--smoke", action="store_true", help="one tiny cell on the smoke profile (CI)")
    parser.add_argument("--jobs", type=int, default=1, help="methods run side by side, each run in its own "
                        "worker process (one core each); more than the number of methods gains nothing")
    parser.add_argument("--bands-only", action="store_true", help="choose and record the bands (step 1, seconds); "
                        "train nothing")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    profile = utility.PROFILES["smoke" if args.smoke else PROFILE]
    methods, epsilons, seeds = (SMOKE["methods"], SMOKE["epsilons"], SMOKE["seeds"]) if args.smoke else \
        (METHODS, EPSILONS, SEEDS)
    tune_epsilon = epsilons[-1] if args.smoke else TUNE_EPSILON
    base = utility.base_config(TRACK, profile, args.data_dir, "", args.work_dir)
    stem = os.path.join(args.out_dir, NAME + ("-smoke" if args.smoke else ""))
    state = json.load(open(stem + ".json")) if os.path.exists(stem + ".json") else {"bands": {}, "runs": []}

    def save() -> None:
        write_atomic(stem + ".json", json.dumps(state, indent=1))
        write_atomic(stem + ".md", report(state, methods, epsilons, seeds, tune_epsilon))

    lock = threading.Lock()

    def recorded(kind, method, epsilon, seed, rate=None):
        with lock:
            return next((r for r in state["runs"] if (r["kind"], r["method"], r["target_epsilon"], r["seed"]) ==
                         (kind, method, epsilon, seed) and rate in (None, r["learning_rate"])), None)

    def record(entry: dict) -> dict:
        with lock:
            state["runs"].append(entry)
            save()
        return entry

    for method in methods:
        for epsilon in epsilons:
            if f"{method}-eps{epsilon:g}" not in state["bands"]:
                bands, comparison = chosen_bands(base, method, epsilon, args.work_dir)
                state["bands"][f"{method}-eps{epsilon:g}"] = {"bands": bands, "comparison": comparison}
                save()
    if args.bands_only:
        print(json.dumps(state["bands"], indent=1))
        return 0

    chosen_rates = {method: concurrent.futures.Future() for method in methods}

    def run(call, kind, method, epsilon, seed, rate, bands):
        print(f"== {kind} {method} eps {epsilon:g} seed {seed} rate {rate:g} bands {bands}", flush=True)
        return record(call(run_record, base, method, epsilon, seed, rate, bands, args.work_dir, kind))

    def method_chain(method: str, call) -> None:
        """One method's runs in order: its rate bracket at epsilon 2, seed 0, then its main cells, seed by
        seed; ``call(run_record, ...)`` runs one training (here or in a worker)."""
        def banded(kind, epsilon, seed, rate):
            return run(call, kind, method, epsilon, seed, rate, state["bands"][f"{method}-eps{epsilon:g}"]["bands"])

        with lock:
            tried = tried_rates(state, method)
        rate = TODAY[method] if not tried else None if args.smoke else next_rate(tried)
        while rate is not None:  # the smoke runs today's rate only
            tried[rate] = banded("tune", tune_epsilon, TUNE_SEED, rate)["val_accuracy"]
            rate = None if args.smoke else next_rate(tried)
        chosen = best_rate(tried)
        chosen_rates[method].set_result(chosen)
        for seed in seeds:
            for epsilon in epsilons:
                if recorded("main", method, epsilon, seed) is not None:
                    continue
                tuned = recorded("tune", method, epsilon, seed, chosen)
                if tuned is not None:  # the bracket's run at the chosen rate is this cell
                    record(dict(tuned, kind="main", reused=True))
                    continue
                banded("main", epsilon, seed, chosen)

    def control_chain(call) -> None:
        """DP-SGD (one band) at BandMF's rate, for each method whose bracket moved the rate, once its bracket
        has chosen; a standard-profile run of the same configuration is reused."""
        for method in methods:
            rate = chosen_rates[method].result()  # raises the method chain's error, if its bracket failed
            if rate == TODAY[method]:
                continue
            for seed in seeds:
                for epsilon in epsilons:
                    if recorded("control", method, epsilon, seed) is not None:
                        continue
                    standard = standard_run(method, epsilon, seed, rate)
                    if standard is not None:
                        record({"kind": "control", "method": method, "target_epsilon": epsilon, "seed": seed,
                                "learning_rate": rate, "bands": 1, "epsilon": standard.get("epsilon"),
                                "test_accuracy": standard["test_accuracy"],
                                "val_accuracy": standard.get("val_accuracy"), "minutes": 0.0, "reused": True,
                                "from": f"{TRACK}-{PROFILE}"})
                        continue
                    run(call, "control", method, epsilon, seed, rate, 1)

    def chain(name: str, call) -> None:
        try:
            control_chain(call) if name == CONTROLS else method_chain(name, call)
        except BaseException as error:  # a bracket that failed must not leave the controls waiting
            if name in chosen_rates and not chosen_rates[name].done():
                chosen_rates[name].set_exception(error)
            raise

    side_by_side(tuple(methods) + (CONTROLS,), args.jobs, chain, prepare=(utility.ensure_pretrained, base))
    save()
    print(report(state, methods, epsilons, seeds, tune_epsilon))
    return 0


if __name__ == "__main__":
    sys.exit(main())
