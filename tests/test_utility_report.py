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


def test_a_column_with_one_private_method_bolds_nothing():
    partial = [r for r in runs() if r["method"] != "all" or r["target_epsilon"] != 1.0]  # eps=1: sparta alone
    table = utility_report.markdown_table(partial, ["sparta", "all", "oracle"])
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "**" not in rows["sparta"].split("|")[2] and "82.00 ± 2.00" in rows["sparta"].split("|")[2]
    assert "**87.00 ± 2.00**" in rows["all"].split("|")[3]  # eps=8 still has two: all best


def test_plots_are_written(tmp_path):
    utility_report.plot_accuracy_vs_epsilon(runs(), str(tmp_path / "eps.png"), "t")
    utility_report.plot_accuracy_vs_trainable(runs(), str(tmp_path / "frac.png"), ["sparta"], "t")
    for name in ("eps.png", "frac.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_validation_curves_plot_is_written(tmp_path):
    curves = {("sparta", 1.0): ([0.5, 0.6, 0.7], 2), ("all", 1.0): ([0.4, 0.6, 0.8], 2), ("all", 8.0): ([0.6] * 3, 1)}
    utility_report.plot_validation_curves(curves, str(tmp_path / "curves.png"), [(1, "warm-up ends")], "t")
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_missing_cells_are_dashes():
    records = [r for r in runs() if not (r["method"] == "all" and r["target_epsilon"] == 8.0)]
    table = utility_report.markdown_table(records, ["sparta", "all"])
    all_row = [line for line in table.splitlines() if line.startswith("| all ")][0]
    assert all_row.rstrip().endswith("| - |")
    with pytest.raises(KeyError):
        utility_report.summarize([{"method": "x"}])


def _paired_runs(sparta, other, eps=2.0):
    return ([{"method": "sparta", "target_epsilon": eps, "seed": s, "private": True, "test_accuracy": a}
             for s, a in enumerate(sparta)]
            + [{"method": "all", "target_epsilon": eps, "seed": s, "private": True, "test_accuracy": a}
               for s, a in enumerate(other)])


def test_paired_difference_interval_is_the_student_t_interval_of_per_seed_differences():
    from scipy import stats

    sparta, other = (0.80, 0.83, 0.79, 0.85, 0.81), (0.78, 0.80, 0.78, 0.81, 0.80)
    d = utility_report.paired_differences(_paired_runs(sparta, other))[("all", 2.0)]
    diffs = [a - b for a, b in zip(sparta, other)]
    reference = stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    assert d.pairs == 5
    assert d.mean == pytest.approx(sum(diffs) / 5)
    assert (d.low, d.high) == (pytest.approx(reference.low), pytest.approx(reference.high))
    assert d.verdict == "win"  # every seed favours sparta: the interval excludes zero


def test_pairing_cancels_a_shared_seed_effect_that_unpaired_spread_would_hide():
    # Seeds differ by 10 points, sparta is 1 point better on every seed: a clear paired win.
    sparta = (0.60, 0.70, 0.80, 0.90)
    other = (0.59, 0.69, 0.79, 0.892)
    d = utility_report.paired_differences(_paired_runs(sparta, other))[("all", 2.0)]
    assert d.verdict == "win" and d.low > 0


def test_no_winner_is_claimed_when_the_interval_contains_zero_or_there_is_one_pair():
    mixed = utility_report.paired_differences(_paired_runs((0.80, 0.70, 0.81), (0.75, 0.76, 0.80)))
    assert mixed[("all", 2.0)].verdict == "tie"
    worse = utility_report.paired_differences(_paired_runs((0.70, 0.71, 0.69), (0.80, 0.81, 0.80)))
    assert worse[("all", 2.0)].verdict == "loss"
    single = utility_report.paired_differences(_paired_runs((0.9,), (0.1,)))[("all", 2.0)]
    assert (single.pairs, single.low, single.verdict) == (1, None, "tie")


def test_only_shared_seeds_are_paired_and_the_table_marks_verdicts():
    runs = _paired_runs((0.80, 0.82, 0.84, 0.99), (0.70, 0.71, 0.72))  # sparta's seed 3 has no partner
    d = utility_report.paired_differences(runs)[("all", 2.0)]
    assert d.pairs == 3 and d.mean == pytest.approx(0.11)
    table = utility_report.paired_table(runs)
    row = [line for line in table.splitlines() if line.startswith("| all ")][0]
    assert "+11.00" in row and "▲" in row and "(n=3)" in row
