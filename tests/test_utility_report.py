"""Utility-benchmark tables and plots from run records."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import utility_report  # noqa: E402


def runs():
    records = []
    for method, accs, private in [("sparta", (0.80, 0.82, 0.84), True), ("all", (0.70, 0.74, 0.72), True),
                                  ("oracle", (0.95, 0.95, 0.95), False)]:
        for eps in (1.0, 8.0):
            for seed, acc in enumerate(accs):
                records.append({"method": method, "target_epsilon": eps, "seed": seed, "private": private,
                                "test_accuracy": acc + (0.05 if eps == 8.0 and method == "all" else 0.0) * 3,
                                "trainable_fraction": 0.2, "density": 0.2})
    return records


def test_summary_mean_and_sample_std():
    summary = utility_report.summarize(runs())
    mean, std, n = summary[("sparta", 1.0)]
    assert (round(mean, 6), round(std, 6), n) == (0.82, 0.02, 3)


def test_table_bolds_best_private_method_per_column_and_marks_nonprivate():
    table = utility_report.markdown_table(runs(), ["sparta", "all", "oracle"])
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "**82.00 ± 2.00**" in rows["sparta"].split("|")[2]  # eps=1: sparta best
    assert "**87.00 ± 2.00**" in rows["all"].split("|")[3]  # eps=8: all best (0.72+0.15)
    assert "**" not in rows["oracle †"]  # non-private is never bolded even though it is highest
    assert "not differentially private" in table


def test_plots_are_written(tmp_path):
    utility_report.plot_accuracy_vs_epsilon(runs(), str(tmp_path / "eps.png"), "t")
    utility_report.plot_accuracy_vs_trainable(runs(), str(tmp_path / "frac.png"), ["sparta"], "t")
    for name in ("eps.png", "frac.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_missing_cells_are_dashes():
    records = [r for r in runs() if not (r["method"] == "all" and r["target_epsilon"] == 8.0)]
    table = utility_report.markdown_table(records, ["sparta", "all"])
    all_row = [line for line in table.splitlines() if line.startswith("| all ")][0]
    assert all_row.rstrip().endswith("| - |")
    with pytest.raises(KeyError):
        utility_report.summarize([{"method": "x"}])
