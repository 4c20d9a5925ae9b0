"""Why, not only who: analyses of utility-benchmark runs beyond the accuracy tables.

* :func:`row_overlap`: the share of SPARTA's privately selected rows that the
  non-private oracle at row granularity (the same warm-up, true gradient magnitudes) also selects,
  ``sum_l |S_l ∩ O_l| / sum_l |S_l|`` over the layers with row selections;
  ``density`` is what a uniformly random choice of rows would score, so overlap
  above it is the signal that survived the noise.
* :func:`selection_budget`: the share of the run's steps and of its epsilon that
  SPARTA's selection epoch takes, from the run's ``plan.json`` (the epsilon the
  selection epoch would cost on its own is computed with the project's accountant).
* :func:`mean_curves` / :func:`phase_table`: validation accuracy after every epoch, averaged over
  seeds, read at SPARTA's phase boundaries. SPARTA trains exactly BiTFiT's parameters for its
  ``T0`` warm-up epochs and updates nothing in its selection epoch, so whatever separates it from
  another method at the end is the head start that method had at epoch ``T0 + 1`` plus what each
  gained in the remaining ``T - T0 - 1`` epochs.
* :func:`warmup_table`: SPARTA with a shorter warm-up (``warmup`` records, ``T0`` in their
  configuration) against the benchmark's SPARTA and full fine-tuning on the same seeds, paired.
* :func:`rate_table`: SPARTA and full fine-tuning at other rates than the ones tuned at the
  tuning epsilon (``rate`` records), paired with their benchmark cells and with each other.
* :func:`public_model_table`: the same methods fine-tuned from a stronger and a weaker public
  model (two profiles that differ only in the pre-trained weights and the rates each tunes; pairs
  whose configurations differ otherwise are left out, and said so): each method's accuracy from
  both, the paired change ``weak - strong`` over shared seeds, and SPARTA's paired gap to each
  method under either model, i.e. how transfer quality moves the ranking.
* :func:`density_table`, :func:`overlap_table` and :func:`budget_table`: markdown for the report.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Sequence

import numpy as np

import utility_report

ROWS_SUFFIX = "::rows"


def mask_rows(run_dir: str) -> dict[str, set[int]]:
    """``{variable: selected rows}`` of the mask a run saved in ``<run_dir>/mask/mask.npz``."""
    path = os.path.join(run_dir, "mask", "mask.npz")
    with np.load(path, allow_pickle=False) as data:
        return {key[: -len(ROWS_SUFFIX)]: set(data[key].tolist()) for key in data.files if key.endswith(ROWS_SUFFIX)}


def selected_rows(record: dict) -> dict[str, set[int]]:
    """The rows a record's run selected: ``selected_rows`` where the record carries them (the report's
    JSON keeps them, so a checkout without ``runs/`` still has them), else its run's saved mask
    (:func:`mask_rows`; ``OSError`` when neither exists)."""
    if record.get("selected_rows") is not None:
        return {name: set(rows) for name, rows in record["selected_rows"].items()}
    if not record.get("run_dir"):
        raise OSError("the record has neither selected rows nor a run directory")
    return mask_rows(record["run_dir"])


def row_overlap(selected: dict[str, set[int]], reference: dict[str, set[int]]) -> float:
    """``sum_l |S_l ∩ R_l| / sum_l |S_l|`` over the variables with rows in both masks."""
    shared = [name for name in selected if name in reference]
    chosen = sum(len(selected[name]) for name in shared)
    if not chosen:
        raise ValueError("the masks select no rows of a common variable: nothing to compare")
    return sum(len(selected[name] & reference[name]) for name in shared) / chosen


def selection_budget(plan: dict) -> dict[str, float]:
    """The selection epoch's share of a SPARTA run's steps and epsilon (``plan.json`` of the run).

    ``epsilon_increment_share``: epsilon after the selection epoch minus before it, at its place in
    the run, as a share of the run's epsilon; ``epsilon_marginal_share``: what the selection epoch
    costs the whole run, ``(eps(T steps) - eps(T - S steps)) / eps(T steps)`` (every phase has the
    plan's one noise multiplier and sample rate, so where the S selection steps sit does not change
    the final epsilon; composition is sublinear, so this is smaller than the increment at an early
    place); ``epsilon_alone``: the epsilon of the selection epoch's steps on their own.
    """
    from sparta_tf.privacy.accounting import compute_epsilon

    phases = plan["phases"]
    names = [phase["name"] for phase in phases]
    if "selection" not in names:
        raise ValueError("the plan has no selection phase")
    index = names.index("selection")
    selection = phases[index]
    before = phases[index - 1]["epsilon_after"] if index else 0.0

    def epsilon_of(steps: int) -> float:
        return compute_epsilon(plan["noise_multiplier"], plan["sample_rate"], steps, plan["delta"],
                               plan.get("accountant", "pld"))

    final = phases[-1]["epsilon_after"]
    return {
        "steps_share": selection["steps"] / plan["steps"],
        "epsilon_increment_share": (selection["epsilon_after"] - before) / final,
        "epsilon_marginal_share": (final - epsilon_of(plan["steps"] - selection["steps"])) / final,
        "epsilon_alone": epsilon_of(selection["steps"]),
        "epsilon": final,
    }


def _by_cell(records: Sequence[dict], method: str, kind: str = "main",
             with_rows: bool = True) -> dict[tuple[float, int], dict]:
    """``{(epsilon, seed): record}`` of ``method``'s ``kind`` records (``with_rows``: only those whose
    rows can be looked up, in the record or its run directory)."""
    return {(float(r["target_epsilon"]), r["seed"]): r for r in records
            if r["method"] == method and r["kind"] == kind
            and (not with_rows or r.get("run_dir") or r.get("selected_rows"))}


def pairs_without_rows(records: Sequence[dict]) -> list[tuple[float, int]]:
    """``(epsilon, seed)`` of the recorded SPARTA/row-oracle pairs whose selected rows are gone (runs
    recorded before results kept them, in a checkout without their ``runs/``)."""
    sparta, oracle = _by_cell(records, "sparta", with_rows=False), _by_cell(records, "oracle", "overlap", False)
    missing = []
    for key in sorted(set(sparta) & set(oracle)):
        try:
            selected_rows(sparta[key]), selected_rows(oracle[key])
        except OSError:
            missing.append(key)
    return missing


def overlap_table(records: Sequence[dict], density: float, planned_budgets: dict | None = None) -> str:
    """Markdown: per epsilon, SPARTA's row overlap with the row oracle (``overlap`` records: the oracle
    at row granularity on SPARTA's seed) and the oracle's test accuracy minus SPARTA's (points), mean ±
    std over shared seeds, with the share of steps and of epsilon SPARTA's selection epoch took (from
    the run's ``plan.json``, else ``planned_budgets``: ``{epsilon: selection_budget}`` of the planned
    runs); empty when no pair has row selections."""
    sparta, oracle = _by_cell(records, "sparta"), _by_cell(records, "oracle", "overlap")
    overlaps: dict[float, list[float]] = {}
    gains: dict[float, list[float]] = {}
    budgets: dict[float, dict | None] = {}
    for key in sorted(set(sparta) & set(oracle)):
        try:
            overlap = row_overlap(selected_rows(sparta[key]), selected_rows(oracle[key]))
        except (OSError, ValueError):  # no selection recorded, or none with rows
            continue
        overlaps.setdefault(key[0], []).append(overlap)
        gains.setdefault(key[0], []).append(100 * (oracle[key]["test_accuracy"] - sparta[key]["test_accuracy"]))
        if budgets.get(key[0]) is None:  # one plan per epsilon: every seed's run has the same steps and noise
            budgets[key[0]] = _run_budget(sparta[key]) or _planned_budget(planned_budgets, key[0])
    if not overlaps:
        return ""
    lines = ["| ε | rows shared with the oracle (chance = density) | oracle's test accuracy minus SPARTA's (points) "
             "| seeds | selection epoch: share of steps | share of ε (run's ε minus ε without it) | its ε alone |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for epsilon, values in sorted(overlaps.items()):
        budget = budgets[epsilon]
        cost = (f"{100 * budget['steps_share']:.1f}% | {100 * budget['epsilon_marginal_share']:.1f}% | "
                f"{budget['epsilon_alone']:.3g}") if budget else "- | - | -"
        lines.append(f"| {epsilon:g} | {_mean_std(values, 100)}% (chance {100 * density:g}%) | "
                     f"{_mean_std(gains[epsilon], 1, '+')} | {len(values)} | {cost} |")
    return "\n".join(lines) + "\n"


def _run_budget(record: dict) -> dict | None:
    """:func:`selection_budget` of the record's run (its ``plan.json``), ``None`` without the run."""
    path = os.path.join(record.get("run_dir") or "", "plan.json")
    if not record.get("run_dir") or not os.path.exists(path):
        return None
    with open(path) as f:
        return selection_budget(json.load(f))


def _planned_budget(planned: dict | None, epsilon: float) -> dict | None:
    """The planned selection budget at ``epsilon`` (JSON keys are strings), ``None`` where there is none."""
    return next((budget for key, budget in (planned or {}).items() if float(key) == epsilon), None)


def _mean_std(values: Sequence[float], scale: float, sign: str = "") -> str:
    """``mean ± std`` (sample std) of ``scale * values``, one decimal; the value alone when there is one."""
    mean = f"{scale * statistics.fmean(values):{sign}.1f}"
    return mean if len(values) == 1 else f"{mean} ± {scale * statistics.stdev(values):.1f}"


def density_table(records: Sequence[dict], methods: Sequence[str]) -> str:
    """Markdown: test accuracy (%) against density for ``methods`` (the density sweep, one seed)."""
    runs = [r for r in records if r["kind"] in ("density", "main") and r["method"] in methods and r["seed"] == 0]
    sweep = {(r["method"], float(r["density"])): r for r in runs if r["kind"] == "density"}
    if not sweep:
        return ""
    densities = sorted({d for _, d in sweep})
    lines = ["| method | " + " | ".join(f"{100 * d:g}% rows" for d in densities) + " |",
             "|---|" + "---:|" * len(densities)]
    for method in methods:
        cells = [f"{100 * sweep[(method, d)]['test_accuracy']:.2f}" if (method, d) in sweep else "-"
                 for d in densities]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def budget_table(budgets: dict[str, dict]) -> str:
    """Markdown: per target epsilon, the selection epoch's share of SPARTA's steps and of its epsilon
    (``{epsilon: selection_budget(plan)}``, from the planned runs: no training needed)."""
    if not budgets:
        return ""
    lines = ["| ε | selection epoch: share of steps | share of ε: run's ε minus ε without it | "
             "ε after it minus ε before it | its ε alone |", "|---:|---:|---:|---:|---:|"]
    for epsilon, budget in sorted(budgets.items(), key=lambda item: float(item[0])):
        lines.append(f"| {float(epsilon):g} | {100 * budget['steps_share']:.1f}% | "
                     f"{100 * budget['epsilon_marginal_share']:.1f}% | {100 * budget['epsilon_increment_share']:.1f}% | "
                     f"{budget['epsilon_alone']:.3g} |")
    return "\n".join(lines) + "\n"


def mean_curves(records: Sequence[dict], methods: Sequence[str]) -> dict[tuple[str, float], tuple[list[float], int]]:
    """``{(method, epsilon): (validation accuracy after each epoch averaged over seeds, seeds)}`` of the
    benchmark (``main``) runs of ``methods`` that recorded a full curve (``val_curve``); runs stopped
    early, with a shorter curve than their epsilon's longest, are left out of the mean."""
    with_curves = [r for r in records if r["kind"] == "main" and r["method"] in methods and r.get("val_curve")]
    curves = {}
    for key, group in utility_report.group_by(with_curves, lambda r: (r["method"], float(r["target_epsilon"]))).items():
        length = max(len(r["val_curve"]) for r in group)
        full = [r["val_curve"] for r in group if len(r["val_curve"]) == length]
        curves[key] = ([statistics.fmean(epoch) for epoch in zip(*full)], len(full))
    return curves


def phase_table(records: Sequence[dict], methods: Sequence[str], warmup_epochs: int) -> str:
    """Markdown: per epsilon and method, mean validation accuracy (%) at the end of SPARTA's warm-up
    (epoch ``T0``), after its selection epoch (``T0 + 1``) and at the end (``T``), and the gain from
    ``T0 + 1`` to ``T``; empty when no run recorded its curve."""
    curves = mean_curves(records, methods)
    if not curves:
        return ""
    selection_end = warmup_epochs + 1
    lines = [f"| ε | method | seeds | epoch {warmup_epochs} (warm-up ends) | epoch {selection_end} (selection ends) "
             "| last epoch | gain after selection |", "|---:|---|---:|---:|---:|---:|---:|"]
    for epsilon in sorted({eps for _, eps in curves}):
        for method in [m for m in methods if (m, epsilon) in curves]:
            curve, seeds = curves[(method, epsilon)]
            if len(curve) <= selection_end:
                continue
            lines.append(f"| {epsilon:g} | {method} | {seeds} | {100 * curve[warmup_epochs - 1]:.1f} | "
                         f"{100 * curve[selection_end - 1]:.1f} | {100 * curve[-1]:.1f} | "
                         f"{100 * (curve[-1] - curve[selection_end - 1]):+.1f} |")
    return "\n".join(lines) + "\n"


def _warmup_of(record: dict, default: int) -> int:
    return (record.get("config") or {}).get("method", {}).get("warmup_epochs", default)


def warmup_table(records: Sequence[dict], default_warmup: int) -> str:
    """Markdown: test accuracy (%) of SPARTA with each ablated warm-up length ``T0`` (``warmup``
    records), of the benchmark's SPARTA (``T0 = default_warmup``) and of ``all`` at the same epsilon,
    over the ablation's seeds (mean ± std), and each ablated SPARTA minus the other two, paired over
    the seeds both ran with a 95% Student-t interval (:func:`utility_report.paired_differences`)."""
    ablated = [r for r in records if r["kind"] == "warmup"]
    if not ablated:
        return ""
    lines = ["| ε | SPARTA T0 | seeds | test accuracy | minus SPARTA T0 = "
             f"{default_warmup} (paired) | minus all (paired) |", "|---:|---:|---:|---:|---:|---:|"]
    by_cell = utility_report.group_by(ablated, lambda r: (float(r["target_epsilon"]), _warmup_of(r, default_warmup)))
    for (epsilon, warmup), group in sorted(by_cell.items()):
        name = f"sparta T0={warmup}"
        seeds = {r["seed"] for r in group}
        others = [r for r in records if r["kind"] == "main" and float(r["target_epsilon"]) == epsilon
                  and r["method"] in ("sparta", "all") and r["seed"] in seeds]
        runs = [dict(r, method=name) for r in group] + others
        differences = utility_report.paired_differences(runs, reference=name)
        mean, std, n = utility_report.summarize(runs)[(name, epsilon)]
        cells = [utility_report.format_mean_std(mean, std)] + [
            utility_report.format_difference(differences[(other, epsilon)]) if (other, epsilon) in differences
            else "-" for other in ("sparta", "all")]
        lines.append(f"| {epsilon:g} | {warmup} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rate_table(records: Sequence[dict], reference: str = "sparta", other: str = "all") -> str:
    """Markdown: the rate ablation (``rate`` records: a method at other rates than its tuned one, at
    one epsilon) beside the method's benchmark cells at the tuned rate on the same seeds. Per method
    and rate: test and validation accuracy (%, mean ± std) and test accuracy minus the tuned rate's,
    paired; then ``reference - other`` for every pair of their rates, paired over shared seeds, and
    for the rates a per-epsilon tuning would pick (highest mean validation accuracy over these seeds;
    like the main tuning, that choice is not covered by the DP guarantee)."""
    ablated = [r for r in records if r["kind"] == "rate"]
    if not ablated:
        return ""
    epsilon = float(ablated[0]["target_epsilon"])
    seeds = {r["seed"] for r in ablated}
    methods = [m for m in (reference, other) if any(r["method"] == m for r in ablated)]
    tuned = {r["method"]: r["learning_rate"] for r in records if r["kind"] == "main" and r["method"] in methods}
    selected = [r for r in records
                if r["method"] in methods and float(r["target_epsilon"]) == epsilon and r["seed"] in seeds
                and (r["kind"] == "rate" or (r["kind"] == "main" and r["learning_rate"] == tuned.get(r["method"])))]
    rates = {m: sorted({r["learning_rate"] for r in selected if r["method"] == m}) for m in methods}
    runs = [dict(r, method=_at_rate(r["method"], r["learning_rate"])) for r in selected]  # one "method" a rate
    stats = utility_report.summarize(runs)
    validation = {label: statistics.fmean(r["val_accuracy"] for r in group)
                  for label, group in utility_report.group_by(runs, lambda r: r["method"]).items()}
    lines = [f"ε = {epsilon:g}, seeds {sorted(seeds)}.", "",
             "| method | lr | seeds | test accuracy | validation accuracy | minus the tuned rate (paired) |",
             "|---|---:|---:|---:|---:|---:|"]
    for method in methods:
        for lr in rates[method]:
            label = _at_rate(method, lr)
            mean, std, n = stats[(label, epsilon)]
            if lr == tuned.get(method):
                change = "(tuned at the tuning ε)"
            elif method not in tuned:  # no benchmark cell recorded to pair with
                change = "-"
            else:
                difference = utility_report.paired_differences(runs, label).get((_at_rate(method, tuned[method]), epsilon))
                change = utility_report.format_difference(difference) if difference else "-"
            lines.append(f"| {method} | {lr:g} | {n} | {utility_report.format_mean_std(mean, std)} | "
                         f"{100 * validation[label]:.2f} | {change} |")
    if len(methods) == 2:
        lines += ["", f"{reference} − {other} (points, paired [95% CI]), rows {reference}'s rate, columns {other}'s:", "",
                  f"| {reference} \\ {other} | " + " | ".join(f"lr {lr:g}" for lr in rates[other]) + " |",
                  "|---|" + "---:|" * len(rates[other])]
        for lr in rates[reference]:
            differences = utility_report.paired_differences(runs, _at_rate(reference, lr))
            cells = [differences.get((_at_rate(other, x), epsilon)) for x in rates[other]]
            lines.append(f"| lr {lr:g} | " + " | ".join(utility_report.format_difference(d) if d else "-"
                                                         for d in cells) + " |")
        picked = {m: max(rates[m], key=lambda lr, m=m: validation[_at_rate(m, lr)]) for m in methods}
        lines += ["", f"Per-ε tuning on these seeds' validation accuracy would pick {reference} "
                  f"{picked[reference]:g} and {other} {picked[other]:g}."]
    return "\n".join(lines) + "\n"


def _at_rate(method: str, lr: float) -> str:
    """The label :func:`rate_table` gives a method at one rate (so the paired statistics treat each
    rate as a method)."""
    return f"{method} lr={lr:g}"


def public_model_table(strong: Sequence[dict], weak: Sequence[dict], methods: Sequence[str],
                       reference: str = "sparta") -> str:
    """Markdown: per method and epsilon, test accuracy (%) from the strong and the weak public model
    (``main`` records of two profiles whose cells differ only in the public model and the tuned rates;
    see :func:`unlike_pairs` for the cells left out because they differ otherwise), the change
    ``weak - strong`` paired over the seeds both ran (mean and 95% Student-t interval, as
    :func:`utility_report.paired_differences`: a change is claimed only where the interval excludes
    zero) and ``reference - method`` under each model (paired means); empty when no method has a
    cell under both models."""
    strong_main = [r for r in strong if r["kind"] == "main" and r["method"] in methods]
    weak_main = [r for r in weak if r["kind"] == "main" and r["method"] in methods]
    unlike = unlike_pairs(strong_main, weak_main)
    strong_main = [r for r in strong_main if _cell_key(r) not in unlike]
    weak_main = [r for r in weak_main if _cell_key(r) not in unlike]
    strong_stats, weak_stats = utility_report.summarize(strong_main), utility_report.summarize(weak_main)
    epsilons = sorted({eps for _, eps in set(strong_stats) & set(weak_stats)})
    if not epsilons:
        return ""
    gaps = {"strong": utility_report.paired_differences(strong_main, reference),
            "weak": utility_report.paired_differences(weak_main, reference)}
    lines = ["| method | ε | strong public model | weak public model | weak − strong, paired [95% CI] (n) | "
             f"{reference} − method: strong → weak |", "|---|---:|---:|---:|---:|---:|"]
    for method in methods:
        change = _model_change(strong_main, weak_main, method)
        for epsilon in epsilons:
            if (method, epsilon) not in strong_stats or (method, epsilon) not in weak_stats:
                continue
            cells = [utility_report.format_mean_std(*strong_stats[(method, epsilon)][:2]),
                     utility_report.format_mean_std(*weak_stats[(method, epsilon)][:2]),
                     utility_report.format_difference(change[epsilon]) if epsilon in change else "-",
                     _gap_change(gaps, method, epsilon, reference)]
            lines.append(f"| {method} | {epsilon:g} | " + " | ".join(cells) + " |")
    lines += ["", "Test accuracy (%), mean ± std over each profile's seeds; the change and the gaps in points. "
              "A non-private method's ε column is its one run per seed, repeated. Learning rates, tuned by each "
              "profile on its own validation runs (strong → weak): " + _rates_line(strong_main, weak_main, methods)
              + "."]
    if unlike:
        differing = sorted({key for keys in unlike.values() for key in keys})
        lines += ["", f"Left out: {len(unlike)} cell{'s' * (len(unlike) != 1)} whose two runs differ in more than the public model and the "
                  f"tuned rates ({', '.join(differing)}), so their difference is not the public model's."]
    return "\n".join(lines) + "\n"


# What may differ between a cell's run from the strong and from the weak public model: the weights,
# where the run lives, and the rates each profile tunes on its own validation runs.
PER_MODEL_SETTINGS = ("model.weights", "output_dir", "training.learning_rate", "training.head_learning_rate")


def unlike_pairs(strong: Sequence[dict], weak: Sequence[dict],
                 allowed: Sequence[str] = PER_MODEL_SETTINGS) -> dict[tuple, list[str]]:
    """``{(method, epsilon, seed): differing settings}`` of the cells run under both models (or, in
    general, under two profiles) whose two configurations (the records' ``config``) differ in a setting
    outside ``allowed`` (dotted keys; default :data:`PER_MODEL_SETTINGS`); records without a
    configuration cannot be checked and are taken as they are."""
    strong_configs = {_cell_key(r): r.get("config") for r in strong}
    unlike = {}
    for record in weak:
        other = strong_configs.get(_cell_key(record))
        if record.get("config") and other:
            differing = [key for key in _differing_settings(other, record["config"]) if key not in allowed]
            if differing:
                unlike[_cell_key(record)] = differing
    return unlike


def _cell_key(record: dict) -> tuple:
    return record["method"], record["target_epsilon"], record["seed"]


def _differing_settings(first: dict, second: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested configurations."""
    differing = []
    for key in sorted(set(first) | set(second)):
        a, b = first.get(key), second.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differing += _differing_settings(a, b, f"{prefix}{key}.")
        elif a != b:
            differing.append(f"{prefix}{key}")
    return differing


def _rates_line(strong: Sequence[dict], weak: Sequence[dict], methods: Sequence[str]) -> str:
    def rates(records: Sequence[dict], method: str) -> str:
        found = sorted({r["learning_rate"] for r in records if r["method"] == method})
        return "/".join(f"{lr:g}" for lr in found) or "-"

    return ", ".join(f"{m} {rates(strong, m)} → {rates(weak, m)}" for m in methods
                     if any(r["method"] == m for r in weak))


def _model_change(strong: Sequence[dict], weak: Sequence[dict], method: str) -> dict[float, "utility_report.PairedDifference"]:
    """``{epsilon: weak - strong}`` of ``method`` paired over shared seeds (the two models relabelled as
    two methods of one run list, so the statistics are :func:`utility_report.paired_differences`')."""
    relabelled = ([dict(r, method="weak") for r in weak if r["method"] == method]
                  + [dict(r, method="strong") for r in strong if r["method"] == method])
    return {eps: d for (_, eps), d in utility_report.paired_differences(relabelled, "weak").items()}


def _gap_change(gaps: dict, method: str, epsilon: float, reference: str) -> str:
    """``reference - method`` (points, paired mean; ★ where its interval excludes zero) under the strong
    then the weak model, ``-`` where a model has no pair."""
    if method == reference:
        return "(reference)"

    def one(model: str) -> str:
        difference = gaps[model].get((method, epsilon))
        if difference is None:
            return "-"
        return f"{100 * difference.mean:+.2f}{' ★' if difference.verdict != 'tie' else ''}"

    return f"{one('strong')} → {one('weak')}"

