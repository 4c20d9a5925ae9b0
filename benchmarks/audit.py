#!/usr/bin/env python
"""Privacy-audit table: claimed epsilon vs one-run lower bound vs MIA AUC, per method and budget.

Every cell is one ``sparta-audit`` run (:func:`trainers.audit.run_audit`) on
the quickstart's task, with the regime changed so that the audit has a
chance: public pre-training of ResNet-20-GN on digits 0-4, DP fine-tuning on
digits 5-9 (fresh head), **expected batch 16, 20 epochs, delta = 1e-5**, and
half of the private training set turned into mislabelled canaries. Cells:
``--methods`` x (epsilon in ``--epsilons``, ``no-noise``,
``no-noise-no-clipping``) x ``--canary-seeds``. The two non-private settings
are the same pipeline with the DP step's noise (and clipping) removed by the
tests' sabotage helper (``tests/broken_mechanism.py``) at the largest
epsilon's hyper-parameters; their ledger's epsilon describes another
mechanism, so the table prints "none" as the claim.

Resumable: each cell's report is stored in ``--out`` (JSON) as soon as it is
done and is not recomputed; ``--report-only`` rewrites the Markdown table.
The pre-trained model is cached in ``--work-dir``.

    python benchmarks/audit.py --canary-seeds 0 1 2   # the docs table (docs/audit.md), ~43 min on 2 shared CPU cores
    python benchmarks/audit.py --methods all --epsilons 1 --no-nonprivate   # one cell
    python benchmarks/audit.py --methods bitfit --epsilons 8 --no-nonprivate --canaries 40 --epochs 1 \
        --work-dir /tmp/w --out /tmp/audit-smoke                              # CI smoke, ~30 s

``--white-box``: the same regime audited with gradient canaries inside the DP step (``sparta-audit
--white-box``, :mod:`sparta_tf.audit.white_box`; ``--canaries`` on ``--canary-variable``), honest at every
epsilon and, claiming epsilon 1, three subtly broken mechanisms (``tests/broken_mechanism.py``): the noise
at half its standard deviation, the sampler at twice its rate, BandMF (4 bands) without its unit column
norm. Its table is ``--out``-white-box.{json,md}:

    python benchmarks/audit.py --white-box --methods all --epsilons 1 2 4 8 --canaries 2000 \
        --canary-variable stage3_block3_conv2/kernel   # docs/audit.md white-box table

``--white-box --data-canaries [N]``: both audits on the same runs. Each run also carries ``N`` data canaries
(half the private training set when ``N`` is left out, as in the black-box table), so one training run gives
the black-box bound (its data canaries, scored by the trained model's loss) and the white-box bounds (its
gradient canaries); the table is ``--out``-both.{json,md}:

    python benchmarks/audit.py --white-box --data-canaries --methods all --epsilons 1 2 8 --no-nonprivate \
        --canaries 2000 --canary-variable stage3_block3_conv2/kernel
    python benchmarks/audit.py --white-box --data-canaries --methods sparta bitfit --epsilons 1 2 8 \
        --no-nonprivate --canaries 300   # their head kernel (64 x 5): the one matrix every phase trains whole
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from trainers.config import load_config  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "quickstart.yaml")
REGIME = ["training.batch_size=16", "privacy.delta=1e-5", "export.enabled=false"]
OUT = os.path.join(ROOT, "benchmarks", "results", "audit-digits")
COLUMNS = ("method", "setting", "canary_seed", "epsilon_claimed", "epsilon_lower_bound", "epsilon_ceiling",
           "correct_guesses", "guesses", "mia_auc", "mia_tpr_at_fpr_1e-3", "mia_train_test_auc",
           "test_accuracy", "seconds")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["sparta", "all", "bitfit"])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 8.0])
    parser.add_argument("--no-nonprivate", action="store_true", help="skip the non-private cells")
    parser.add_argument("--canary-seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--canaries", type=int, default=None, help="default: half the private training set")
    parser.add_argument("--epochs", type=int, default=20, help="training epochs (20; fewer for a smoke run)")
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "audit-bench"))
    parser.add_argument("--out", default=OUT, help="stem of the .json / .md outputs")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--white-box", action="store_true", help="gradient canaries in the DP step (module doc)")
    parser.add_argument("--canary-variable", default=None, help="with --white-box: the canaries' variable")
    parser.add_argument("--data-canaries", type=int, nargs="?", const=-1, default=None, metavar="N",
                        help="with --white-box: N data canaries in the same runs too (module doc)")
    return parser.parse_args(argv)


SUBTLE = {"half-noise": ({"noise_scale": 0.5}, []), "double-rate": ({"rate_scale": 2.0}, []),
          "unnormalised-bands": ({"unnormalised_bands": True}, ["privacy.bands=4"])}
"""The white-box table's broken mechanisms, each claiming epsilon 1: the sabotage and its config overrides."""


def white_box_cells(args) -> list[tuple[str, str, int]]:
    settings = [f"{eps:g}" for eps in args.epsilons] + ([] if args.no_nonprivate else list(SUBTLE))
    return [(m, s, seed) for seed in args.canary_seeds for s in settings for m in args.methods]


def run_white_box_cell(args, method: str, setting: str, seed: int) -> dict:
    import tensorflow as tf

    from broken_mechanism import subtly_broken_mechanism
    from trainers.audit import run_white_box_audit

    sabotage, extra = SUBTLE.get(setting, ({}, []))
    epsilon = 1.0 if setting in SUBTLE else float(setting)
    overrides = REGIME + extra + [
        f"training.epochs={args.epochs}", f"method.name={method}", f"privacy.target_epsilon={epsilon}",
        f"pretrain.checkpoint={os.path.join(args.work_dir, 'pretrained.keras')}",
        f"output_dir={os.path.join(args.work_dir, 'white-box-' + cell_key(method, setting, seed))}"]
    if method != "sparta":
        overrides.append("method.warmup_epochs=0")
    config = load_config(CONFIG, overrides)
    shutil.rmtree(config["output_dir"], ignore_errors=True)
    tf.keras.backend.clear_session()
    start = time.perf_counter()
    with subtly_broken_mechanism(**sabotage):
        report = run_white_box_audit(config, args.canaries, seed=seed, variable=args.canary_variable,
                                     data_canaries=args.data_canaries)
    return report | {"setting": setting, "canary_seed": seed, "seconds": time.perf_counter() - start,
                     "epochs": args.epochs, "variable": args.canary_variable or "the head kernel"}


def expected_bound(report: dict) -> str:
    """The steps bound of the exact mechanism at the claim, simulated as the report does
    (:func:`~sparta_tf.audit.power.simulated_bound`, recomputed: reports of other versions ran fewer trials);
    "—" with correlated noise."""
    from sparta_tf.audit.power import simulated_bound

    if "steps" not in report["bounds"]:
        return "—"
    bound = simulated_bound(report["noise_multiplier"], report["sample_rate"], report["observed_steps"],
                            report["canaries"], report["delta"],
                            confidence=report["bounds"]["steps"]["confidence"])  # as the measured bound's
    return f"{bound.mean:.2f} ({bound.low:.2f}-{bound.high:.2f})"


def white_box_markdown(results: dict) -> str:
    """One row per cell: the claim, each bound, the ceiling, each check (measured [99.9% interval] vs claimed)."""
    rows = ["| method | mechanism | ε claimed | bound: steps or prefix sum | bound: final model | exact mechanism at "
            "the claim: steps bound, simulated | ceiling | noise std measured vs claimed | rate measured vs claimed "
            "| verdict | canaries | steps observed | s |", "|" + "---|" * 13]
    for report in sorted(results.values(), key=lambda r: (r["method"], r["setting"] in SUBTLE, r["setting"])):
        bounds = report["bounds"]
        first = next(name for name in bounds if name != "final_model")
        checks = report["checks"]

        def check(name):
            if name not in checks:
                return "—"
            c = checks[name]
            return f"{c['estimate']:.3g} [{c['low']:.3g}, {c['high']:.3g}] vs {c['claimed']:.3g}"

        verdict = ("contradicts" if report["contradicts_claim"] else
                   "mismatch: " + ", ".join(report["mismatches"]) if report["mismatches"] else "consistent")
        rows.append(f"| {report['method']} | {'honest' if report['setting'] not in SUBTLE else report['setting']} "
                    f"| {report['claimed_epsilon']:.2f} | {bounds[first]['epsilon_lower_bound']:.2f} ({first}) "
                    f"| {bounds['final_model']['epsilon_lower_bound']:.2f} | {expected_bound(report)} "
                    f"| {report['ceiling']:.2f} | {check('noise_std')} | {check('sample_rate')} | {verdict} | {report['canaries']} "
                    f"| {report['observed_steps']} | {report['seconds']:.0f} |")
    return "\n".join(rows) + "\n"


def both_markdown(results: dict) -> str:
    """One row per cell: the black-box and the white-box bounds of the same run, each beside its ceiling."""
    rows = ["| method | mechanism | ε claimed | black box: bound | black box: ceiling | white box: bound (steps or "
            "prefix sum) | white box: bound (final model) | white box: exact mechanism, simulated | white box: "
            "ceiling | white-box checks | canaries: data / gradient (on) | test accuracy | s |", "|" + "---|" * 13]
    for report in sorted(results.values(), key=lambda r: (r["method"], r["setting"] in SUBTLE, r["setting"])):
        bounds, black = report["bounds"], report["black_box"]
        first = next(name for name in bounds if name != "final_model")
        checks = "mismatch: " + ", ".join(report["mismatches"]) if report["mismatches"] else "match the ledger"
        rows.append(f"| {report['method']} | {'honest' if report['setting'] not in SUBTLE else report['setting']} "
                    f"| {report['claimed_epsilon']:.2f} | {black['epsilon_lower_bound']:.2f} "
                    f"| {black['epsilon_ceiling']:.2f} | {bounds[first]['epsilon_lower_bound']:.2f} ({first}) "
                    f"| {bounds['final_model']['epsilon_lower_bound']:.2f} | {expected_bound(report)} "
                    f"| {report['ceiling']:.2f} | {checks} "
                    f"| {black['canaries']} / {report['canaries']} ({report['variable']}) "
                    f"| {report['test_accuracy']:.3f} | {report['seconds']:.0f} |")
    return "\n".join(rows) + "\n"


def white_box_main(args) -> int:
    """The white-box table (with ``--data-canaries``, both audits' table): every missing cell run and saved as
    soon as it is done, then the Markdown."""
    both = args.data_canaries is not None
    stem = args.out + ("-both" if both else "-white-box")
    json_path, md_path = stem + ".json", stem + ".md"
    results = load(json_path)
    missing = [] if args.report_only else [c for c in white_box_cells(args) if cell_key(*c) not in results]
    for method, setting, seed in missing:
        os.makedirs(args.work_dir, exist_ok=True)
        print(f"== white-box cell {cell_key(method, setting, seed)}", flush=True)
        results[cell_key(method, setting, seed)] = run_white_box_cell(args, method, setting, seed)
        save(json_path, results)
    table = (both_markdown if both else white_box_markdown)(results)
    with open(md_path, "w") as f:
        f.write(table)
    print(table)
    return 0


BROKEN = {"no-noise": {"noise": False}, "no-noise-no-clipping": {"noise": False, "clipping": False}}


def cells(args) -> list[tuple[str, str, int]]:
    settings = [f"{eps:g}" for eps in args.epsilons] + ([] if args.no_nonprivate else list(BROKEN))
    return [(m, s, seed) for seed in args.canary_seeds for s in settings for m in args.methods]


def cell_key(method: str, setting: str, seed: int) -> str:
    named = setting in BROKEN or setting in SUBTLE
    return f"{method}-{setting if named else 'eps' + setting}-canaryseed{seed}"


def run_cell(args, method: str, setting: str, seed: int) -> dict:
    import tensorflow as tf

    from broken_mechanism import broken_mechanism
    from trainers.audit import run_audit

    epsilon = max(args.epsilons) if setting in BROKEN else float(setting)
    overrides = REGIME + [f"training.epochs={args.epochs}", f"method.name={method}", f"privacy.target_epsilon={epsilon}",
                          f"pretrain.checkpoint={os.path.join(args.work_dir, 'pretrained.keras')}",
                          f"output_dir={os.path.join(args.work_dir, cell_key(method, setting, seed))}"]
    if method != "sparta":
        overrides.append("method.warmup_epochs=0")
    config = load_config(CONFIG, overrides)
    shutil.rmtree(config["output_dir"], ignore_errors=True)  # an interrupted cell starts over
    tf.keras.backend.clear_session()
    start = time.perf_counter()
    if setting in BROKEN:
        with broken_mechanism(**BROKEN[setting]):
            report = run_audit(config, args.canaries, seed=seed)
        report |= {"epsilon_claimed": None, "passed": None}  # the ledger's number describes another mechanism
    else:
        report = run_audit(config, args.canaries, seed=seed)
    return report | {"setting": setting, "canary_seed": seed, "seconds": time.perf_counter() - start}


def load(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def save(path: str, results: dict) -> None:
    from sparta_tf.atomic_files import write_atomic

    write_atomic(path, json.dumps(results, indent=1))


def _number(value, digits=2) -> str:
    return "none" if value is None else f"{value:.{digits}f}"


def _mean_std(values, digits=3) -> str:
    values = np.asarray(values, float)
    return f"{values.mean():.{digits}f}" + (f" ± {values.std(ddof=1):.{digits}f}" if len(values) > 1 else "")


def summary_rows(results: dict) -> list[str]:
    """One row per method x setting: the bound of every canary seed, means ± std of the rest."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for report in results.values():
        groups.setdefault((report["method"], report["setting"]), []).append(report)
    order = {setting: k for k, setting in enumerate(["1", "2", "4", "8", *BROKEN])}
    rows = []
    for (method, setting), reports in sorted(groups.items(), key=lambda g: (g[0][0], order.get(g[0][1], 99))):
        reports.sort(key=lambda r: r["canary_seed"])
        claimed = reports[0]["epsilon_claimed"]
        rows.append(
            f"| {method} | {setting if setting in BROKEN else 'DP'} | {_number(claimed)} "
            f"| {' / '.join(_number(r['epsilon_lower_bound']) for r in reports)} "
            f"| {_number(reports[0]['epsilon_ceiling'])} | {_mean_std([r['mia_auc'] for r in reports])} "
            f"| {_mean_std([r['mia_tpr_at_fpr_1e-3'] for r in reports])} "
            f"| {_mean_std([r['mia_train_test_auc'] for r in reports])} "
            f"| {_mean_std([r['test_accuracy'] for r in reports])} | {len(reports)} |")
    return rows


def markdown(results: dict) -> str:
    header = ["| method | mechanism | ε claimed | ε lower bound (95%), per canary seed | ceiling | canary MIA AUC "
              "| TPR @ FPR 1e-3 | train-vs-test MIA AUC | test accuracy | seeds |", "|" + "---|" * 10]
    cells = ["| method | setting | canary seed | ε claimed | ε lower bound | correct / guesses | MIA AUC "
             "| TPR @ FPR 1e-3 | s |", "|" + "---|" * 9]
    for report in sorted(results.values(), key=lambda r: (r["method"], r["setting"], r["canary_seed"])):
        cells.append(
            f"| {report['method']} | {report['setting']} | {report['canary_seed']} "
            f"| {_number(report['epsilon_claimed'])} | {_number(report['epsilon_lower_bound'])} "
            f"| {report['correct_guesses']} / {report['guesses']} | {_number(report['mia_auc'], 3)} "
            f"| {_number(report['mia_tpr_at_fpr_1e-3'], 3)} | {report['seconds']:.0f} |")
    total = sum(r["seconds"] for r in results.values()) / 60
    return ("\n".join(header + summary_rows(results)) + "\n\nEvery cell (" + f"{total:.0f} min of audit runs):\n\n"
            + "\n".join(cells) + "\n")


def _same_regime(record: dict, args) -> bool:
    return record["epochs"] == args.epochs and args.canaries in (None, record["canaries"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.white_box:
        return white_box_main(args)
    json_path, md_path = args.out + ".json", args.out + ".md"
    results = load(json_path)
    if not args.report_only:
        os.makedirs(args.work_dir, exist_ok=True)
        for method, setting, seed in cells(args):
            key = cell_key(method, setting, seed)
            if key in results:
                if not _same_regime(results[key], args):
                    sys.exit(f"error: cell {key} in {json_path} was run with epochs={results[key]['epochs']} and "
                             f"{results[key]['canaries']} canaries; pass another --out for this regime")
                continue
            print(f"== cell {key}", flush=True)
            results[key] = {k: v for k, v in run_cell(args, method, setting, seed).items()
                            if k in COLUMNS or k in ("canaries", "delta", "confidence", "passed")}
            results[key]["epochs"] = args.epochs
            save(json_path, results)
    with open(md_path, "w") as f:
        f.write(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
