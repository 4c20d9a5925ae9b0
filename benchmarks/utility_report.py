"""Tables and plots of utility-benchmark runs (methods x epsilon x seeds).

Input: a list of run records (dicts) with at least ``method``, ``target_epsilon``,
``seed``, ``test_accuracy``, ``private`` and optionally ``trainable_fraction``
and ``density``. Output:

* :func:`markdown_table`: methods x epsilon, ``mean ± std`` over seeds (sample
  std, ``n-1``), the best mean of every column in bold, non-private methods
  marked with a dagger and never bolded (they are not comparable at a budget);
* :func:`paired_differences` / :func:`paired_table`: the reference method (SPARTA)
  minus every other method over the seeds both ran, with a 95% Student-t
  confidence interval; a method is beaten (or beats SPARTA) only when the
  interval excludes zero;
* :func:`plot_accuracy_vs_epsilon`: one line per method with std error bars;
* :func:`plot_accuracy_vs_trainable`: accuracy against % trainable parameters
  for the sparse methods (the SPARTA paper's Figure 3);
* :func:`plot_validation_curves`: validation accuracy after every epoch (mean
  over seeds), one panel per epsilon, with SPARTA's phase boundaries marked.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Iterable, NamedTuple, Sequence


def group_by(runs: Iterable[dict], key) -> dict:
    groups = collections.defaultdict(list)
    for run in runs:
        groups[key(run)].append(run)
    return groups


def summarize(runs: Iterable[dict]) -> dict[tuple[str, float], tuple[float, float, int]]:
    """``{(method, epsilon): (mean accuracy, std, number of seeds)}``."""
    summary = {}
    for (method, epsilon), group in group_by(runs, lambda r: (r["method"], float(r["target_epsilon"]))).items():
        accuracies = [float(r["test_accuracy"]) for r in group]
        std = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
        summary[(method, epsilon)] = (statistics.fmean(accuracies), std, len(accuracies))
    return summary


class PairedDifference(NamedTuple):
    """``reference - other`` over shared seeds: mean, 95% CI ``[low, high]`` (None for one pair), pairs."""

    mean: float
    low: float | None
    high: float | None
    pairs: int

    @property
    def verdict(self) -> str:
        """``win`` / ``loss`` when the interval excludes zero (for the reference), else ``tie``."""
        if self.low is not None and self.low > 0:
            return "win"
        if self.high is not None and self.high < 0:
            return "loss"
        return "tie"


def paired_differences(runs: Iterable[dict], reference: str = "sparta",
                       confidence: float = 0.95) -> dict[tuple[str, float], PairedDifference]:
    """``{(other method, epsilon): PairedDifference}`` of test accuracy, ``reference - other``.

    Pairs are runs with the same seed (same data split, initialisation and
    Poisson samples where the methods share them), so the seed-to-seed spread
    common to both methods cancels. With ``d_s`` the difference on seed ``s``
    and ``n`` pairs: ``mean = d̄``, interval ``d̄ ± t_{(1+confidence)/2, n-1} · sd(d) / sqrt(n)``
    (Student t, sample std). Non-private methods are compared too (the table
    marks them); a method never run on a shared seed is left out.
    """
    from scipy import stats

    by_cell = {(r["method"], float(r["target_epsilon"]), r["seed"]): float(r["test_accuracy"]) for r in runs}
    differences = {}
    for method, epsilon in sorted({(m, e) for m, e, _ in by_cell if m != reference}):
        pairs = [by_cell[(reference, epsilon, s)] - by_cell[(method, epsilon, s)]
                 for m, e, s in by_cell if (m, e) == (method, epsilon) and (reference, epsilon, s) in by_cell]
        if not pairs:
            continue
        mean = statistics.fmean(pairs)
        if len(pairs) < 2:
            differences[(method, epsilon)] = PairedDifference(mean, None, None, 1)
            continue
        half = stats.t.ppf((1 + confidence) / 2, len(pairs) - 1) * statistics.stdev(pairs) / math.sqrt(len(pairs))
        differences[(method, epsilon)] = PairedDifference(mean, mean - half, mean + half, len(pairs))
    return differences


def format_difference(difference: PairedDifference) -> str:
    """``mean [low, high] (n=pairs)`` in points (``mean (1 pair, no interval)`` for a single pair)."""
    if difference.low is None:
        return f"{100 * difference.mean:+.2f} (1 pair, no interval)"
    return (f"{100 * difference.mean:+.2f} [{100 * difference.low:+.2f}, {100 * difference.high:+.2f}] "
            f"(n={difference.pairs})")


def paired_table(runs: Sequence[dict], method_order: Sequence[str] | None = None, reference: str = "sparta") -> str:
    """Markdown: ``reference - method`` in points, ``mean [95% CI] (pairs)``, with the verdict marked."""
    differences = paired_differences(runs, reference)
    nonprivate = {r["method"] for r in runs if not r.get("private", True)}
    epsilons = sorted({eps for _, eps in differences})
    methods = [m for m in (method_order or sorted({m for m, _ in differences})) if m != reference]
    marks = {"win": f" ▲ {reference} better", "loss": f" ▼ {reference} worse", "tie": ""}
    lines = [f"| {reference} − method | " + " | ".join(f"ε = {eps:g}" for eps in epsilons) + " |",
             "|---|" + "---:|" * len(epsilons)]
    for method in methods:
        if not any((method, eps) in differences for eps in epsilons):
            continue
        cells = []
        for eps in epsilons:
            d = differences.get((method, eps))
            if d is None:
                cells.append("-")
            else:
                cells.append(format_difference(d) + marks[d.verdict])
        lines.append(f"| {method}{' †' if method in nonprivate else ''} | " + " | ".join(cells) + " |")
    lines += ["", f"Points of test accuracy, {reference} minus the method on the same seeds, with a 95% "
              "Student-t interval; ▲/▼ only where the interval excludes zero (otherwise no winner is claimed)."]
    return "\n".join(lines) + "\n"


def format_mean_std(mean: float, std: float) -> str:
    """An accuracy (a fraction) as ``mean ± std`` in %, two decimals: the tables' cell format."""
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def markdown_table(runs: Sequence[dict], method_order: Sequence[str] | None = None) -> str:
    """Methods x epsilon, accuracy in % as ``mean ± std``, best private mean per column in bold (where at
    least two private methods have a value)."""
    summary = summarize(runs)
    nonprivate = {r["method"] for r in runs if not r.get("private", True)}
    epsilons = sorted({eps for _, eps in summary})
    methods = list(method_order or sorted({m for m, _ in summary}))
    best = {}
    for eps in epsilons:
        candidates = [summary[(m, eps)][0] for m in methods if (m, eps) in summary and m not in nonprivate]
        best[eps] = max(candidates) if len(candidates) > 1 else None  # one method alone is no 'best'
    lines = ["| method | " + " | ".join(f"ε = {eps:g}" for eps in epsilons) + " |",
             "|---|" + "---:|" * len(epsilons)]
    for method in methods:
        cells = []
        for eps in epsilons:
            if (method, eps) not in summary:
                cells.append("-")
                continue
            mean, std, n = summary[(method, eps)]
            cell = format_mean_std(mean, std)
            if method not in nonprivate and best[eps] is not None and mean == best[eps]:
                cell = f"**{cell}**"
            cells.append(cell)
        name = f"{method} †" if method in nonprivate else method
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if nonprivate:
        lines.append("")
        lines.append("† not differentially private (mask or training without a DP guarantee); never bolded.")
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_epsilon(runs: Sequence[dict], path: str, title: str = "") -> None:
    """Accuracy (mean ± std over seeds) against epsilon, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(runs)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab20").colors
    markers = "os^vD<>Pp*hX"
    for index, method in enumerate(sorted({m for m, _ in summary})):
        points = sorted((eps, *summary[(method, eps)][:2]) for m, eps in summary if m == method)
        axes.errorbar([p[0] for p in points], [100 * p[1] for p in points], yerr=[100 * p[2] for p in points],
                      marker=markers[index % len(markers)], color=colors[(2 * index) % 20 + (index // 10) % 2],
                      linestyle="--" if method in ("nonprivate", "oracle") else "-", capsize=3, label=method)
    epsilons = sorted({eps for _, eps in summary})
    axes.set_xscale("log")
    axes.set_xticks(epsilons)
    axes.set_xticklabels([f"{eps:g}" for eps in epsilons])
    axes.minorticks_off()
    axes.set_xlabel("ε (δ fixed)")
    axes.set_ylabel("test accuracy (%)")
    axes.set_title(title)
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_accuracy_vs_trainable(runs: Sequence[dict], path: str, methods: Sequence[str], title: str = "") -> None:
    """Accuracy against % trainable parameters (mean over seeds) for ``methods``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for method in methods:
        chosen = [r for r in runs if r["method"] == method and "trainable_fraction" in r]
        groups = group_by(chosen, lambda r: float(r.get("density", r["trainable_fraction"])))
        points = sorted(
            (statistics.fmean(r["trainable_fraction"] for r in g), statistics.fmean(r["test_accuracy"] for r in g))
            for g in groups.values()
        )
        if points:
            axes.plot([100 * p[0] for p in points], [100 * p[1] for p in points], marker="o", label=method)
    axes.set_xlabel("trainable parameters (%)")
    axes.set_ylabel("test accuracy (%)")
    axes.set_title(title)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_validation_curves(curves: dict[tuple[str, float], tuple[Sequence[float], int]], path: str,
                           boundaries: Sequence[tuple[int, str]] = (), title: str = "") -> None:
    """One panel per epsilon, one line per method: ``curves[(method, epsilon)] = (mean validation
    accuracy after each epoch, seeds)``; ``boundaries``: ``(epoch, label)`` drawn as vertical lines
    (the end of SPARTA's warm-up and of its selection epoch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epsilons = sorted({eps for _, eps in curves})
    methods = sorted({m for m, _ in curves})
    figure, panels = plt.subplots(1, len(epsilons), figsize=(4.2 * len(epsilons), 3.8), sharey=True, squeeze=False)
    for panel, epsilon in zip(panels[0], epsilons):
        for index, method in enumerate(methods):
            if (method, epsilon) in curves:
                curve, seeds = curves[(method, epsilon)]
                panel.plot(range(1, len(curve) + 1), [100 * v for v in curve], color=f"C{index}",
                           label=f"{method} ({seeds} seeds)")
        for epoch, label in boundaries:
            panel.axvline(epoch, color="grey", linestyle=":", linewidth=1)
            panel.annotate(label, (epoch, 0.02), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                           color="grey", ha="right", va="bottom")
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))
        panel.set_title(f"ε = {epsilon:g}")
        panel.set_xlabel("epoch")
        panel.legend(fontsize=7, loc="lower right")
    panels[0][0].set_ylabel("validation accuracy (%), mean over seeds")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
