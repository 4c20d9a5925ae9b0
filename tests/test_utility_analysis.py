"""Utility-benchmark analyses: SPARTA-vs-oracle row overlap and the selection epoch's cost."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import utility_analysis  # noqa: E402
from sparta_tf.privacy.accounting import compute_epsilon  # noqa: E402


def _run_dir(tmp_path, name, rows: dict, plan=None):
    run_dir = tmp_path / name
    (run_dir / "mask").mkdir(parents=True)
    np.savez(run_dir / "mask" / "mask.npz", **{f"{k}::rows": np.array(v, np.int64) for k, v in rows.items()},
             **{"head/bias:0::dense": np.zeros(0, np.int64)})
    if plan is not None:
        (run_dir / "plan.json").write_text(json.dumps(plan))
    return str(run_dir)


def test_row_overlap_counts_shared_rows_over_selected_rows(tmp_path):
    a = utility_analysis.mask_rows(_run_dir(tmp_path, "a", {"d1/kernel:0": [0, 1, 2, 3], "d2/kernel:0": [5]}))
    b = utility_analysis.mask_rows(_run_dir(tmp_path, "b", {"d1/kernel:0": [2, 3, 9, 8], "d2/kernel:0": [6]}))
    assert utility_analysis.row_overlap(a, b) == pytest.approx(2 / 5)
    assert utility_analysis.row_overlap(a, a) == 1.0
    with pytest.raises(ValueError, match="no rows"):
        utility_analysis.row_overlap({"x": {1}}, {"y": {1}})


def _plan(sigma=1.5, q=0.05, steps=(80, 20, 300)):
    phases, total = [], 0
    for name, count in zip(("warmup", "selection", "sparse"), steps):
        total += count
        phases.append({"name": name, "steps": count, "epsilon_after": compute_epsilon(sigma, q, total, 1e-5)})
    return {"phases": phases, "steps": total, "noise_multiplier": sigma, "sample_rate": q, "delta": 1e-5,
            "accountant": "pld"}


def test_selection_budget_is_its_share_of_steps_and_of_the_composed_epsilon():
    plan = _plan()
    budget = utility_analysis.selection_budget(plan)
    assert budget["steps_share"] == pytest.approx(20 / 400)
    eps = [p["epsilon_after"] for p in plan["phases"]]
    assert budget["epsilon_increment_share"] == pytest.approx((eps[1] - eps[0]) / eps[2])
    assert budget["epsilon_alone"] == pytest.approx(compute_epsilon(1.5, 0.05, 20, 1e-5))
    # composition is sublinear: 20 steps alone cost more than the increment they add after 80
    assert budget["epsilon_alone"] > eps[1] - eps[0]
    # what the selection epoch costs the whole run: eps(400 steps) - eps(380 steps), smaller still
    without = compute_epsilon(1.5, 0.05, 380, 1e-5)
    assert budget["epsilon_marginal_share"] == pytest.approx((eps[2] - without) / eps[2])
    assert 0 < budget["epsilon_marginal_share"] < budget["epsilon_increment_share"]
    with pytest.raises(ValueError, match="no selection"):
        utility_analysis.selection_budget(dict(plan, phases=[plan["phases"][0]]))


def test_overlap_table_pairs_sparta_with_the_row_oracle_on_the_same_epsilon_and_seed(tmp_path):
    records = []
    for seed, oracle_rows in enumerate(([0, 1, 2, 3], [0, 1, 8, 9])):
        for method, kind, rows, accuracy in (("sparta", "main", [0, 1, 2, 3], 0.70),
                                             ("oracle", "overlap", oracle_rows, 0.71 + 0.02 * seed)):
            run_dir = _run_dir(tmp_path, f"{method}{seed}", {"d/kernel:0": rows}, _plan())
            records.append({"kind": kind, "method": method, "target_epsilon": 2.0, "seed": seed,
                            "run_dir": run_dir, "test_accuracy": accuracy})
    table = utility_analysis.overlap_table(records, 0.2)
    row = [line for line in table.splitlines() if line.startswith("| 2 |")][0]
    assert "75.0 ± 35.4%" in row and "5.0%" in row  # mean of 1.0 and 0.5; 20/400 steps
    assert "+2.0 ± 1.4" in row  # oracle minus SPARTA: +1 and +3 points
    one_seed = utility_analysis.overlap_table([r for r in records if r["seed"] == 0], 0.2)
    assert "| 2 | 100.0% (chance 20%) | +1.0 | 1 |" in one_seed  # no spread claimed from one seed
    assert utility_analysis.overlap_table([r for r in records if r["method"] == "sparta"], 0.2) == ""
    # the benchmark's own oracle cells (entries, kind "main") are not the row oracle
    main_oracle = [dict(r, kind="main") if r["method"] == "oracle" else r for r in records]
    assert utility_analysis.overlap_table(main_oracle, 0.2) == ""


def test_overlap_table_reads_rows_kept_in_the_records_when_the_runs_are_gone():
    planned = {"2.0": utility_analysis.selection_budget(_plan())}
    records = [{"kind": kind, "method": method, "target_epsilon": 2.0, "seed": 0, "run_dir": "/gone",
                "selected_rows": {"d/kernel:0": rows}, "test_accuracy": accuracy}
               for method, kind, rows, accuracy in (("sparta", "main", [0, 1, 2, 3], 0.70),
                                                    ("oracle", "overlap", [0, 1, 8, 9], 0.73))]
    table = utility_analysis.overlap_table(records, 0.2, planned)
    assert "| 2 | 50.0% (chance 20%) | +3.0 | 1 | 5.0% |" in table  # budget from the planned runs
    assert "| 2 | 50.0% (chance 20%) | +3.0 | 1 | - | - | - |" in utility_analysis.overlap_table(records, 0.2)


def test_overlap_table_skips_pairs_whose_oracle_mask_has_no_rows(tmp_path):
    # an oracle at entry granularity (its default): its mask has no ``::rows`` arrays to compare
    sparta = _run_dir(tmp_path, "sparta", {"d/kernel:0": [0, 1]}, _plan())
    oracle = tmp_path / "oracle"
    (oracle / "mask").mkdir(parents=True)
    np.savez(oracle / "mask" / "mask.npz", **{"d/kernel:0::entries": np.array([0, 5], np.int64)})
    records = [{"kind": kind, "method": method, "target_epsilon": 8.0, "seed": 0, "run_dir": run_dir,
                "test_accuracy": 0.5} for method, kind, run_dir in (("sparta", "main", sparta),
                                                                      ("oracle", "overlap", str(oracle)))]
    assert utility_analysis.overlap_table(records, 0.2) == ""


def _curve_record(method, seed, curve, kind="main", eps=2.0):
    return {"kind": kind, "method": method, "target_epsilon": eps, "seed": seed, "val_curve": curve}


def test_mean_curves_average_full_curves_per_method_and_epsilon_and_skip_short_ones():
    records = [_curve_record("sparta", 0, [0.2, 0.4, 0.6]), _curve_record("sparta", 1, [0.4, 0.6, 0.8]),
               _curve_record("sparta", 2, [0.9]),  # stopped early: not averaged with full curves
               _curve_record("sparta", 0, [0.1, 0.1, 0.1], kind="tune"),  # tuning runs are not benchmark cells
               _curve_record("sparta", 0, [0.5, 0.5, 0.5], eps=8.0), _curve_record("mp", 0, [0.3, 0.3, 0.3]),
               _curve_record("all", 0, [])]
    curves = utility_analysis.mean_curves(records, ["sparta", "all"])
    assert set(curves) == {("sparta", 2.0), ("sparta", 8.0)}
    assert curves[("sparta", 2.0)][0] == pytest.approx([0.3, 0.5, 0.7]) and curves[("sparta", 2.0)][1] == 2
    assert curves[("sparta", 8.0)] == ([0.5, 0.5, 0.5], 1)
    assert utility_analysis.phase_table([], ["sparta"], 1) == ""


def test_phase_table_reads_the_warmup_end_the_selection_end_and_the_last_epoch():
    records = [_curve_record("sparta", 0, [0.1, 0.2, 0.3, 0.4, 0.9]), _curve_record("mp", 0, [0.5, 0.6, 0.7, 0.7, 0.8])]
    table = utility_analysis.phase_table(records, ["sparta", "mp"], warmup_epochs=2)
    assert "| epoch 2 (warm-up ends) | epoch 3 (selection ends) |" in table
    assert "| 2 | sparta | 1 | 20.0 | 30.0 | 90.0 | +60.0 |" in table
    assert "| 2 | mp | 1 | 60.0 | 70.0 | 80.0 | +10.0 |" in table


def _accuracy_record(method, seed, accuracy, kind="main", warmup=None, eps=1.0):
    config = {"method": {"name": method, **({"warmup_epochs": warmup} if warmup is not None else {})}}
    return {"kind": kind, "method": method, "target_epsilon": eps, "seed": seed, "test_accuracy": accuracy,
            "config": config}


def test_warmup_table_pairs_the_shorter_warmup_with_sparta_and_all_on_its_seeds():
    records = [_accuracy_record("sparta", s, a, kind="warmup", warmup=1) for s, a in enumerate((0.72, 0.74, 0.73))]
    records += [_accuracy_record("sparta", s, a) for s, a in enumerate((0.70, 0.73, 0.71, 0.60))]  # seed 3: unpaired
    records += [_accuracy_record("all", s, a) for s, a in enumerate((0.73, 0.74, 0.74))]
    records += [_accuracy_record("sparta", 0, 0.99, eps=8.0)]  # another epsilon: not paired
    table = utility_analysis.warmup_table(records, default_warmup=4)
    row = [line for line in table.splitlines() if line.startswith("| 1 | 1 |")][0]
    # T0 = 1 minus T0 = 4: +2, +1, +2 points; minus all: -1, 0, -1
    assert row.startswith("| 1 | 1 | 3 | 73.00 ± 1.00 | +1.67 [")
    assert "(n=3) | -0.67 [" in row
    assert utility_analysis.warmup_table(records[3:], default_warmup=4) == ""
