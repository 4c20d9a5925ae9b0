"""Utility-benchmark runner: which cells share a run, and when a cached run is reused."""

import json
import math
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import utility  # noqa: E402

PROFILE = utility.PROFILES["quick"]


def test_tuning_run_of_the_chosen_rate_is_the_tune_epsilon_seed0_cell(tmp_path):
    tune_dir = utility.cell_dir(str(tmp_path), PROFILE, "sparta", PROFILE["tune_epsilon"], 0, 0.1, 0.2)
    assert tune_dir == os.path.join(str(tmp_path), "tune", "sparta", "lr0.1")
    # Other seeds, epsilons and densities are their own runs.
    others = {utility.cell_dir(str(tmp_path), PROFILE, "sparta", eps, seed, 0.1, density)
              for eps, seed, density in [(1.0, 0, 0.2), (PROFILE["tune_epsilon"], 1, 0.2),
                                         (PROFILE["tune_epsilon"], 0, 0.05), (8.0, 2, 0.2)]}
    assert tune_dir not in others and len(others) == 4


def test_nonprivate_ceiling_has_one_run_per_seed_whatever_the_epsilon(tmp_path):
    dirs = {eps: utility.cell_dir(str(tmp_path), PROFILE, "nonprivate", eps, 1, 0.1, 0.2) for eps in (1.0, 2.0, 8.0)}
    assert len(set(dirs.values())) == 1
    seed0 = {utility.cell_dir(str(tmp_path), PROFILE, "nonprivate", eps, 0, 0.1, 0.2) for eps in (1.0, 8.0)}
    assert seed0 == {os.path.join(str(tmp_path), "tune", "nonprivate", "lr0.1")}
    # ...but a private method's epsilons are separate runs.
    private = {utility.cell_dir(str(tmp_path), PROFILE, "all", eps, 1, 0.1, 0.2) for eps in (1.0, 2.0, 8.0)}
    assert len(private) == 3


@pytest.fixture
def fake_train(monkeypatch):
    """Replaces the trainer by a recorder (the runner's caching is what is under test)."""
    calls = []

    def train(config):
        calls.append(config["output_dir"])
        os.makedirs(config["output_dir"], exist_ok=True)
        return {"method": config["method"]["name"], "test_accuracy": 0.5 + 0.01 * len(calls),
                "trainable_fraction": 0.2}

    from trainers import run

    monkeypatch.setattr(run, "train", train)
    return calls


def _config(tmp_path, lr=0.1):
    base = {"data": {"source": "synthetic"}, "model": {"name": "small_cnn"}, "privacy": {"delta": 1e-5},
            "training": {"epochs": 2}}
    return utility.cell_config(base, "sparta", 2.0, 0, lr, 0.2, str(tmp_path / "cell"))


def test_nonprivate_ceiling_applies_the_configs_process_settings_before_training(tmp_path, monkeypatch):
    """``training.deterministic`` reaches the ceiling, which trains outside ``run.train``."""
    from sparta_tf import determinism

    class Applied(Exception):
        pass

    def make_deterministic():
        raise Applied

    monkeypatch.setattr(determinism, "make_deterministic", make_deterministic)
    config = {"output_dir": str(tmp_path / "ceiling"), "training": {"deterministic": True, "seed": 0}}
    with pytest.raises(Applied):
        utility._nonprivate(config)


def test_finished_cell_with_same_configuration_is_not_recomputed(tmp_path, fake_train, monkeypatch):
    monkeypatch.setattr(utility, "validate_config", lambda config: config)
    first = utility.run_cell(_config(tmp_path), "sparta")
    again = utility.run_cell(_config(tmp_path), "sparta")
    assert len(fake_train) == 1 and again["test_accuracy"] == first["test_accuracy"]
    stored = json.loads((tmp_path / "cell" / "results.json").read_text())
    assert stored["cell"]["training"]["learning_rate"] == 0.1


def test_cell_with_another_configuration_or_unfinished_is_run_again_from_scratch(tmp_path, fake_train, monkeypatch):
    monkeypatch.setattr(utility, "validate_config", lambda config: config)
    utility.run_cell(_config(tmp_path), "sparta")
    (tmp_path / "cell" / "stale-file").write_text("from the old run")
    utility.run_cell(_config(tmp_path, lr=0.03), "sparta")  # same directory, another configuration
    assert len(fake_train) == 2
    assert not (tmp_path / "cell" / "stale-file").exists()
    # An unfinished cell (no results.json) is started again.
    os.remove(tmp_path / "cell" / "results.json")
    (tmp_path / "cell" / "half-written").write_text("x")
    utility.run_cell(_config(tmp_path, lr=0.03), "sparta")
    assert len(fake_train) == 3 and not (tmp_path / "cell" / "half-written").exists()


def test_a_cached_run_without_selected_rows_runs_again_only_where_the_row_overlap_needs_them(
        tmp_path, fake_train, monkeypatch):
    """Runs recorded before results kept ``selected_rows`` (or restored from such records) cannot be
    paired with the row oracle: the cells the overlap pairs run them again; other cells reuse them."""
    monkeypatch.setattr(utility, "validate_config", lambda config: config)
    monkeypatch.setattr(utility, "_saved_selection", lambda run_dir: {})  # a run that kept no rows
    utility.run_cell(_config(tmp_path), "sparta")
    utility.run_cell(_config(tmp_path), "sparta")  # no cell needs its rows: reused
    assert len(fake_train) == 1
    monkeypatch.setattr(utility, "_saved_selection", lambda run_dir: {"conv/kernel": [0, 3]})
    again = utility.run_cell(_config(tmp_path), "sparta", needs_rows=True)
    assert len(fake_train) == 2 and again["selected_rows"] == {"conv/kernel": [0, 3]}
    utility.run_cell(_config(tmp_path), "sparta", needs_rows=True)  # now it has them: reused
    assert len(fake_train) == 2


def test_the_row_overlaps_cells_are_the_ones_that_need_selected_rows(tmp_path):
    profile = utility.PROFILES["standard"]
    base = {"training": {"epochs": 20}, "privacy": {}}
    planned = utility.benchmark_cells(base, profile, ["sparta", "all"], {"sparta": 0.1, "all": 0.03}, str(tmp_path))
    needing = {(c.kind, c.method, c.epsilon, c.seed) for c in planned if c.needs_rows}
    oracle_seeds = profile["row_oracle"]["seeds"]
    assert needing == {(kind, method, epsilon, seed) for seed in oracle_seeds for epsilon in profile["epsilons"]
                       for kind, method in (("main", "sparta"), ("overlap", "oracle"))}
    cells = [c for c in planned if c.needs_rows]
    assert utility.cached_results(cells) == {}  # nothing has run


def _record(method, eps, seed, accuracy, kind="main", lr=0.03, density=0.2, seconds=10.0, private=True):
    return {"kind": kind, "method": method, "target_epsilon": eps, "seed": seed, "learning_rate": lr,
            "density": density, "private": private, "epsilon": eps if private else None, "test_accuracy": accuracy,
            "val_accuracy": accuracy, "trainable_fraction": 0.2, "seconds": seconds}


def test_report_only_rebuilds_table_from_recorded_runs_and_counts_shared_runs_once(tmp_path):
    profile = utility.PROFILES["smoke"]
    records = [_record("sparta", 8.0, 0, 0.6, kind="tune"), _record("sparta", 8.0, 0, 0.6),
               _record("all", 8.0, 0, 0.4), _record("nonprivate", 8.0, 0, 0.9, private=False)]
    stored = {"profile": utility._comparable(profile), "delta": utility.DELTA, "elapsed_s": 5.0, "runs": records}
    (tmp_path / "cifar10-transfer-smoke.json").write_text(json.dumps(stored))
    assert utility.main(["--track", "cifar10-transfer", "--profile", "smoke", "--data-dir", str(tmp_path),
                         "--out-dir", str(tmp_path), "--report-only"]) == 0
    report = (tmp_path / "cifar10-transfer-smoke.md").read_text()
    assert "| sparta | **60.00 ± 0.00** |" in report and "| all | 40.00 ± 0.00 |" in report
    assert "nonprivate †" in report
    # the tuning run and the main (epsilon 8, seed 0) cell are one run
    assert "compute: 3 runs" in report
    # a rewrite repeats the last benchmark invocation's wall clock instead of adding its own
    assert "this invocation: 5 s" in report
    assert json.loads((tmp_path / "cifar10-transfer-smoke.json").read_text())["elapsed_s"] == 5.0
    assert (tmp_path / "cifar10-transfer-smoke-accuracy-vs-epsilon.png").stat().st_size > 0


def test_report_reads_validation_curves_at_spartas_phase_boundaries(tmp_path, monkeypatch):
    profile = dict(utility.PROFILES["smoke"], epochs=3)  # T0 = max(1, 3 // 5) = 1: selection ends at epoch 2
    monkeypatch.setitem(utility.PROFILES, "smoke", profile)
    curves = {"sparta": [0.5, 0.5, 0.7], "all": [0.4, 0.6, 0.65], "nonprivate": [0.8, 0.9, 0.95]}
    records = [dict(_record(method, 8.0, 0, curve[-1], private=method != "nonprivate"), val_curve=curve)
               for method, curve in curves.items()]
    stored = {"profile": utility._comparable(profile), "delta": utility.DELTA, "elapsed_s": 5.0,
              "runs": records + [_record("bitfit", 8.0, 0, 0.5),  # a run recorded before curves were: left out
                                 dict(_record("sparta", 8.0, 0, 0.8, kind="warmup"),
                                      config={"method": {"name": "sparta", "warmup_epochs": 0}})]}
    (tmp_path / "cifar10-transfer-smoke.json").write_text(json.dumps(stored))
    assert utility.main(["--track", "cifar10-transfer", "--profile", "smoke", "--data-dir", str(tmp_path),
                         "--out-dir", str(tmp_path), "--report-only"]) == 0
    report = (tmp_path / "cifar10-transfer-smoke.md").read_text()
    assert "| epoch 1 (warm-up ends) | epoch 2 (selection ends) |" in report
    phases = report.split("## Where the gaps open")[1]
    rows = {line.split(" | ")[1]: line for line in phases.splitlines() if line.startswith("| 8 | ")}
    assert set(rows) == {"sparta", "all"}  # private methods with a curve only
    assert rows["sparta"] == "| 8 | sparta | 1 | 50.0 | 50.0 | 70.0 | +20.0 |"
    assert rows["all"] == "| 8 | all | 1 | 40.0 | 60.0 | 65.0 | +5.0 |"
    assert (tmp_path / "cifar10-transfer-smoke-validation-curves.png").stat().st_size > 1000
    assert "| 8 | 0 | 1 | 80.00 ± 0.00 | +10.00 (1 pair, no interval) | +15.00 (1 pair, no interval) |" in report


def test_weak_model_report_sets_each_method_beside_the_strong_models_runs_paired_over_seeds(tmp_path):
    """The standard-weak report (a profile name with a hyphen) reads the standard report beside it."""
    strong = {("sparta", 1.0): (0.70, 0.72, 0.74), ("all", 1.0): (0.75, 0.76, 0.77)}
    weak = {("sparta", 1.0): (0.60, 0.61, 0.65), ("all", 1.0): (0.70, 0.70, 0.71)}

    def runs(accuracies):
        return [_record(method, eps, seed, accuracy) for (method, eps), values in accuracies.items()
                for seed, accuracy in enumerate(values)]

    for profile, accuracies in (("standard", strong), ("standard-weak", weak)):
        stored = {"profile": utility._comparable(utility.PROFILES[profile]), "delta": utility.DELTA,
                  "elapsed_s": 5.0, "runs": runs(accuracies)}
        (tmp_path / f"mnist-to-fashion-{profile}.json").write_text(json.dumps(stored))
    assert utility.main(["--track", "mnist-to-fashion", "--profile", "standard-weak", "--data-dir", str(tmp_path),
                         "--out-dir", str(tmp_path), "--report-only"]) == 0
    report = (tmp_path / "mnist-to-fashion-standard-weak.md").read_text()
    section = report.split("## How the public model's strength moves the ranking")[1]
    rows = {line.split(" | ")[0][2:]: line for line in section.splitlines() if line.startswith("| ") and " | 1 | " in line}
    # sparta: weak - strong = -10, -11, -9 points: mean -10, sd 1, t(0.975, 2) * 1 / sqrt(3) = 2.48
    assert rows["sparta"] == ("| sparta | 1 | 72.00 ± 2.00 | 62.00 ± 2.65 | -10.00 [-12.48, -7.52] (n=3) "
                              "| (reference) |")
    # sparta - all: strong -5, -4, -3 (interval excludes 0); weak -10, -9, -6 (it excludes 0 too)
    assert rows["all"].endswith("| -4.00 ★ → -8.33 ★ |")
    assert "mnist-resnet20-gn-weak" in report and "mnist-resnet20-gn'" in section
    assert "(strong → weak): sparta 0.03 → 0.03, all 0.03 → 0.03." in section
    assert "Left out" not in section


def test_weak_model_table_leaves_out_pairs_that_differ_in_more_than_the_model_and_the_rates():
    """Each profile tunes its own rates; any other difference (here: T) would be read as the model's."""
    import utility_analysis

    def run(model, seed, accuracy, lr=0.1, epochs=20):
        config = {"model": {"name": "pretrained", "weights": model}, "output_dir": f"/runs/{model}/{seed}",
                  "training": {"learning_rate": lr, "head_learning_rate": 10 * lr, "epochs": epochs}}
        return dict(_record("sparta", 2.0, seed, accuracy, lr=lr), config=config)

    strong = [run("strong", seed, 0.70) for seed in range(3)]
    weak = [run("weak", 0, 0.60, lr=0.3), run("weak", 1, 0.61, lr=0.3), run("weak", 2, 0.90, lr=0.3, epochs=40)]
    assert utility_analysis.unlike_pairs(strong, weak) == {("sparta", 2.0, 2): ["training.epochs"]}
    table = utility_analysis.public_model_table(strong, weak, ["sparta"])
    row = [line for line in table.splitlines() if line.startswith("| sparta | 2 |")][0]
    # seed 2 is left out of both columns: -10 and -9 over seeds 0-1 (the 40-epoch run would add +20)
    assert "| 70.00 ± 0.00 | 60.50 ± 0.71 | -9.50" in row and "(n=2)" in row
    assert "Left out: 1 cell whose" in table and "(training.epochs)" in table
    assert "sparta 0.1 → 0.3." in table


def test_report_only_refuses_missing_or_stale_results(tmp_path):
    args = ["--track", "cifar10-transfer", "--profile", "smoke", "--data-dir", str(tmp_path),
            "--out-dir", str(tmp_path), "--report-only"]
    with pytest.raises(SystemExit, match="does not exist"):
        utility.main(args)
    stale = dict(utility._comparable(utility.PROFILES["smoke"]), epochs=99)
    (tmp_path / "cifar10-transfer-smoke.json").write_text(json.dumps({"profile": stale, "elapsed_s": 1.0, "runs": []}))
    with pytest.raises(SystemExit, match="another 'smoke' profile"):
        utility.main(args)
    removed = dict(utility._comparable(utility.PROFILES["smoke"]), retired_analysis={"epsilon": 8.0})  # gone since
    (tmp_path / "cifar10-transfer-smoke.json").write_text(json.dumps({"profile": removed, "elapsed_s": 1.0, "runs": []}))
    with pytest.raises(SystemExit, match="another 'smoke' profile"):
        utility.main(args)


def test_report_only_accepts_a_report_made_before_the_profile_gained_an_analysis(tmp_path, monkeypatch):
    """A key added to the profile since (here a new ablation) plans new cells; the recorded ones stand."""
    older = utility._comparable(utility.PROFILES["smoke"])
    monkeypatch.setitem(utility.PROFILES, "smoke", dict(utility.PROFILES["smoke"], rate_ablation={"epsilon": 8.0}))
    stored = {"profile": older, "delta": utility.DELTA, "elapsed_s": 5.0, "runs": [_record("sparta", 8.0, 0, 0.6)]}
    (tmp_path / "cifar10-transfer-smoke.json").write_text(json.dumps(stored))
    assert utility.main(["--track", "cifar10-transfer", "--profile", "smoke", "--data-dir", str(tmp_path),
                         "--out-dir", str(tmp_path), "--report-only"]) == 0
    report = (tmp_path / "cifar10-transfer-smoke.md").read_text()
    assert "| sparta | 60.00 ± 0.00 |" in report  # the recorded run stands (alone in its column: not bolded)
    assert "rate_ablation: all of its cells (the profile gained it after the last benchmark run)" in report


def test_missing_line_estimates_the_remaining_time_from_each_methods_median_run():
    records = [{"method": "sparta", "seconds": s} for s in (600.0, 900.0, 3600.0)] + [
        {"method": "all", "seconds": 1800.0}, {"method": "bitfit", "seconds": None}]
    missing = [{"cell": cell, "kind": cell.split()[0], "method": cell.split()[1], "rerun_for_rows": False} for cell in (
        "main sparta eps=2 seed=3", "main all eps=2 seed=3", "density mp eps=2 seed=0 density=0.1",
        "main bitfit eps=2 seed=3")] + [
        {"cell": "rate_ablation: all of its cells (the profile gained it)", "kind": None, "method": None,
         "rerun_for_rows": False}]
    line = utility._missing_line(missing, records)
    # sparta's median 900 s + all's 1800 s = 0.75 h; mp and bitfit (no timed run) and the entry that is
    # not one cell (not an `all` run, though its label's second word is "all") are named as not counted
    assert line.startswith("missing: 5 planned cells have not run yet (about 0.8 h of run wall clock")
    assert "3 entries without a timed run of their method not counted" in line
    assert line.endswith("density=0.1; main bitfit eps=2 seed=3; rate_ablation: all of its cells (the profile gained it)")
    assert utility._missing_line([], records) == "missing: none (every planned cell has run)"


def test_missing_entries_of_reports_written_before_they_were_structured_are_read_as_cells():
    assert utility._missing_entry("density mp eps=2 seed=0 density=0.1") == {
        "cell": "density mp eps=2 seed=0 density=0.1", "kind": "density", "method": "mp", "rerun_for_rows": False}
    assert utility._missing_entry("overlap oracle eps=1 seed=0 granularity=row" + utility.RERUN_FOR_ROWS) == {
        "cell": "overlap oracle eps=1 seed=0 granularity=row", "kind": "overlap", "method": "oracle",
        "rerun_for_rows": True}
    gained = utility._missing_entry("row_oracle: all of its cells (the profile gained it after the last benchmark run)")
    assert gained["kind"] is None and gained["method"] is None
    entry = {"cell": "main all eps=8 seed=4", "kind": "main", "method": "all", "rerun_for_rows": False}
    assert utility._missing_entry(entry) == entry
    without_kind = {"cell": "overlap oracle eps=2 seed=0 granularity=row", "method": "oracle", "rerun_for_rows": True}
    assert utility._missing_entry(without_kind) == dict(without_kind, kind="overlap")  # a report of Nov 2026
    assert utility.missing_of_methods_not_run([without_kind], ["sparta"]) == [dict(without_kind, kind="overlap")]


def test_rate_with_best_private_validation_accuracy_is_chosen_first_on_ties(tmp_path):
    base = {"training": {"epochs": 4}, "privacy": {}}
    cells = utility.tuning_cells(base, PROFILE, ["sparta", "all"], str(tmp_path))
    assert [(c.method, c.lr) for c in cells] == [(m, lr) for m in ("sparta", "all") for lr in PROFILE["lr_grid"]]
    val = {("sparta", 0.03): 0.4, ("sparta", 0.1): 0.5, ("all", 0.03): 0.3, ("all", 0.1): 0.3}
    results = [{"history": {"val_accuracy": [0.0, val[(c.method, c.lr)]]}} for c in cells]
    assert utility.chosen_rates(cells, results) == {"sparta": 0.1, "all": 0.03}


def test_benchmark_cells_cover_every_method_epsilon_seed_and_the_density_sweep(tmp_path):
    base = {"training": {"epochs": 4}, "privacy": {}}
    methods = ["sparta", "all", "nonprivate"]
    cells = utility.benchmark_cells(base, PROFILE, methods, {m: 0.03 for m in methods}, str(tmp_path))
    main = [c for c in cells if c.kind == "main"]
    assert len(main) == len(methods) * len(PROFILE["epsilons"]) * len(PROFILE["seeds"])
    assert {(c.method, c.epsilon, c.seed) for c in main} == {
        (m, e, s) for m in methods for e in PROFILE["epsilons"] for s in PROFILE["seeds"]}
    density = [c for c in cells if c.kind == "density"]
    assert [(c.method, c.density) for c in density] == [("sparta", d) for d in PROFILE["densities"]]
    # the ceiling's cells all train at the tuning epsilon (it ignores epsilon), private ones at their own
    assert {c.config["privacy"]["target_epsilon"] for c in main if c.method == "nonprivate"} == {PROFILE["tune_epsilon"]}
    assert {c.config["privacy"]["target_epsilon"] for c in main if c.method == "all"} == set(PROFILE["epsilons"])


def _tuning(grid_val: dict, methods=("sparta",)):
    cells = [utility.Cell("tune", m, 2.0, 0, lr, 0.2, {}) for m in methods for lr in sorted(grid_val[m])]
    results = [{"history": {"val_accuracy": [grid_val[c.method][c.lr]]}} for c in cells]
    return cells, results


def test_a_best_rate_at_an_edge_of_the_grid_extends_the_grid_along_the_ladder():
    low = {"sparta": {0.003: 0.6, 0.01: 0.5, 0.03: 0.4}}
    high = {"sparta": {0.003: 0.4, 0.01: 0.5, 0.03: 0.6}}
    inside = {"sparta": {0.003: 0.4, 0.01: 0.6, 0.03: 0.5}}
    assert utility.bracket_extensions(*_tuning(low)) == {"sparta": 0.001}
    assert utility.bracket_extensions(*_tuning(high)) == {"sparta": 0.1}
    assert utility.bracket_extensions(*_tuning(inside)) == {}
    # the ladder's end stops the search
    end = {"sparta": {utility.LR_LADDER[0]: 0.9, utility.LR_LADDER[1]: 0.1}}
    assert utility.bracket_extensions(*_tuning(end)) == {}


def test_tuning_extends_only_methods_at_an_edge_until_every_choice_is_bracketed(tmp_path, monkeypatch):
    # validation accuracy peaks at 0.001 for sparta (below the grid) and at 0.03 for all (inside it)
    peak = {"sparta": 0.001, "all": 0.03}
    ran = []

    class Runner:
        def run(self, tasks, on_result=None):
            ran.extend((t[1].method, t[1].lr) for t in tasks)
            return [{"history": {"val_accuracy": [1.0 - abs(math.log10(t[1].lr / peak[t[1].method]))]}}
                    for t in tasks]

    profile = utility.PROFILES["standard"]
    base = {"training": {"epochs": 20}, "privacy": {}}
    cells, results = utility.tune(Runner(), base, profile, ["sparta", "all"], str(tmp_path))
    assert utility.chosen_rates(cells, results) == {"sparta": 0.001, "all": 0.03}
    assert sorted(c.lr for c in cells if c.method == "sparta") == [0.0003, 0.001, 0.003, 0.01, 0.03, 0.1]
    assert sorted(c.lr for c in cells if c.method == "all") == list(profile["lr_grid"])


def test_warmup_ablation_runs_sparta_with_each_shorter_warmup_in_its_own_directory(tmp_path):
    profile = utility.PROFILES["standard"]
    base = {"training": {"epochs": 20}, "privacy": {}}
    rates = {"sparta": 0.1, "all": 0.03}
    cells = [c for c in utility.benchmark_cells(base, profile, ["sparta", "all"], rates, str(tmp_path))
             if c.kind == "warmup"]
    ablation = profile["warmup_ablation"]
    assert [(c.method, c.epsilon, c.seed, c.lr, c.config["method"]["warmup_epochs"]) for c in cells] == [
        ("sparta", ablation["epsilon"], seed, 0.1, warmup) for warmup in ablation["warmup_epochs"]
        for seed in ablation["seeds"]]
    main = [c for c in utility.benchmark_cells(base, profile, ["sparta"], rates, str(tmp_path))
            if c.kind == "main" and c.epsilon == ablation["epsilon"] and c.seed == 0][0]
    assert "warmup_epochs" not in main.config["method"]  # the benchmark's SPARTA keeps the default T0
    assert len({c.config["output_dir"] for c in cells} | {main.config["output_dir"]}) == len(cells) + 1
    assert utility._missing(cells[:1], {}) == [{"cell": f"warmup sparta eps=1 seed=0 warmup_epochs={ablation['warmup_epochs'][0]}",
                                                "kind": "warmup", "method": "sparta", "rerun_for_rows": False}]
    assert utility.warmup_ablation_cells(base, profile, ["all"], rates, str(tmp_path)) == []
    config = dict(cells[0].config, data={"source": "npz", "path": "x"}, model={"name": "cifar_resnet_gn"})
    assert utility.validate_config(config)["method"]["warmup_epochs"] == ablation["warmup_epochs"][0]


def test_row_oracle_runs_the_oracle_at_row_granularity_with_spartas_configuration_and_rate(tmp_path):
    profile = utility.PROFILES["standard"]
    base = {"training": {"epochs": 20}, "privacy": {}}
    rates = {"sparta": 0.1, "all": 0.03}
    planned = utility.benchmark_cells(base, profile, ["sparta", "all"], rates, str(tmp_path))
    cells = [c for c in planned if c.kind == "overlap"]
    assert [(c.method, c.epsilon, c.seed, c.lr) for c in cells] == [
        ("oracle", epsilon, seed, 0.1) for seed in profile["row_oracle"]["seeds"] for epsilon in profile["epsilons"]]
    for cell in cells:
        sparta = [c for c in planned
                  if (c.kind, c.method, c.epsilon, c.seed) == ("main", "sparta", cell.epsilon, cell.seed)][0]
        # SPARTA's configuration but for the method (same seed: the same warm-up batches and noise)
        assert cell.config["method"] == dict(sparta.config["method"], name="oracle", granularity="row")
        assert {k: v for k, v in cell.config.items() if k not in ("method", "output_dir")} == {
            k: v for k, v in sparta.config.items() if k not in ("method", "output_dir")}
    # one directory per cell but one: the sweep's default-density cell is SPARTA's eps-2 seed-0 main run
    assert len({c.config["output_dir"] for c in planned}) == len(planned) - 1
    assert [e["cell"] for e in utility._missing(cells[:1], {})] == ["overlap oracle eps=1 seed=0 granularity=row"]
    assert utility.row_oracle_cells(base, profile, ["all"], rates, str(tmp_path)) == []
    runs, _ = utility.split_by_epsilon(planned, [8.0])
    assert [c for c in runs if c.kind == "overlap"] == cells  # they run whatever --epsilons says
    config = dict(cells[0].config, data={"source": "npz", "path": "x"}, model={"name": "cifar_resnet_gn"})
    assert utility.validate_config(config)["method"]["granularity"] == "row"


def test_rate_ablation_runs_sparta_and_all_a_rung_below_their_tuned_rate_before_the_row_oracle(tmp_path):
    profile = utility.PROFILES["standard"]
    ablation = profile["rate_ablation"]
    base = {"training": {"epochs": 20}, "privacy": {}}
    rates = {"sparta": 0.3, "all": 0.1, "bitfit": 0.1}
    planned = utility.benchmark_cells(base, profile, ["sparta", "all", "bitfit"], rates, str(tmp_path))
    cells = [c for c in planned if c.kind == "rate"]
    below = {"sparta": 0.1, "all": 0.03}  # one rung down LR_LADDER
    assert [(c.method, c.epsilon, c.seed, c.lr) for c in cells] == [
        (m, ablation["epsilon"], seed, below[m]) for seed in ablation["seeds"] for m in ("sparta", "all")]
    for cell in cells:
        main = [c for c in planned if (c.kind, c.method, c.epsilon, c.seed) == ("main", cell.method, cell.epsilon, cell.seed)][0]
        assert cell.config["training"] == dict(main.config["training"], learning_rate=cell.lr,
                                               head_learning_rate=10 * cell.lr)
        assert {k: v for k, v in cell.config.items() if k not in ("training", "output_dir")} == {
            k: v for k, v in main.config.items() if k not in ("training", "output_dir")}
    assert len({c.config["output_dir"] for c in planned}) == len(planned) - 1  # only the tuning cell is shared
    kinds = [c.kind for c in planned]
    assert max(i for i, k in enumerate(kinds) if k == "rate") < kinds.index("overlap")
    assert [e["cell"] for e in utility._missing(cells[:1], {})] == ["rate sparta eps=1 seed=0 lr=0.1"]
    assert utility.rate_ablation_cells(base, profile, ["bitfit"], rates, str(tmp_path)) == []
    assert [c.lr for c in utility.rate_ablation_cells(base, profile, ["all"], {"all": 0.0001}, str(tmp_path))] == []


def test_rate_table_pairs_each_rate_with_the_tuned_one_and_sparta_with_all(tmp_path):
    import utility_analysis

    def run(method, kind, lr, seed, test, val):
        return dict(_record(method, 1.0, seed, test, kind=kind, lr=lr), val_accuracy=val)

    records = ([run("sparta", "main", 0.3, s, a, 0.60) for s, a in enumerate((0.64, 0.65, 0.63))]
               + [run("sparta", "rate", 0.1, s, a, 0.66) for s, a in enumerate((0.68, 0.70, 0.69))]
               + [run("all", "main", 0.1, s, a, 0.70) for s, a in enumerate((0.70, 0.71, 0.72))]
               + [run("all", "rate", 0.03, s, a, 0.69) for s, a in enumerate((0.69, 0.69, 0.69))]
               + [run("sparta", "main", 0.3, 3, 0.99, 0.99),  # a seed the ablation did not run: left out
                  dict(run("sparta", "main", 0.3, 0, 0.5, 0.5), target_epsilon=2.0)])
    table = utility_analysis.rate_table(records)
    rows = {tuple(line.split(" | ")[:2]): line for line in table.splitlines() if line.startswith("| sparta |")
            or line.startswith("| all |")}
    assert rows[("| sparta", "0.3")] == "| sparta | 0.3 | 3 | 64.00 ± 1.00 | 60.00 | (tuned at the tuning ε) |"
    # 0.1 - 0.3 per seed: +4, +5, +6 points: mean 5, sd 1, t(0.975, 2) / sqrt(3) = 2.48
    assert rows[("| sparta", "0.1")] == "| sparta | 0.1 | 3 | 69.00 ± 1.00 | 66.00 | +5.00 [+2.52, +7.48] (n=3) |"
    assert rows[("| all", "0.03")].endswith("| 69.00 | -2.00 [-4.48, +0.48] (n=3) |")
    grid = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| lr ")}
    # columns: all at 0.03, then 0.1; e.g. sparta 0.3 - all 0.1 per seed: -6, -6, -9 (sd sqrt(3): +-4.30)
    assert grid["| lr 0.3"] == "| lr 0.3 | -5.00 [-7.48, -2.52] (n=3) | -7.00 [-11.30, -2.70] (n=3) |"
    assert grid["| lr 0.1"] == "| lr 0.1 | +0.00 [-2.48, +2.48] (n=3) | -2.00 [-4.48, +0.48] (n=3) |"
    assert "would pick sparta 0.1 and all 0.1." in table
    assert utility_analysis.rate_table([r for r in records if r["kind"] == "main"]) == ""
    alone = utility_analysis.rate_table([r for r in records if r["kind"] == "rate"])  # nothing to pair with
    assert "| sparta | 0.1 | 3 | 69.00 ± 1.00 | 66.00 | - |" in alone


def test_runs_that_would_only_recover_their_rows_go_last_and_stay_reported_meanwhile(tmp_path, fake_train, monkeypatch):
    monkeypatch.setattr(utility, "validate_config", lambda config: config)
    monkeypatch.setattr(utility, "_saved_selection", lambda run_dir: {})

    def cell(name, needs_rows):
        config = utility.cell_config({"data": {}, "privacy": {}, "training": {}}, "sparta", 1.0, 0, 0.1, 0.2,
                                     str(tmp_path / name))
        return utility.Cell("main", "sparta", 1.0, 0, 0.1, 0.2, config, needs_rows)

    old, new, plain = cell("old", True), cell("new", True), cell("plain", False)
    utility.run_cell(old.config, "sparta")  # a run that kept no rows
    assert utility.row_reruns_last([old, new, plain]) == [new, plain, old]
    reported = utility.cached_results([old, new, plain])
    assert list(reported) == [0]  # reported until its re-run replaces it
    # ... and named as missing until then: the report must not say every planned cell has run
    assert [(e["cell"], e["rerun_for_rows"]) for e in utility._missing([old, new, plain], reported)] == [
        ("main sparta eps=1 seed=0", True), ("main sparta eps=1 seed=0", False), ("main sparta eps=1 seed=0", False)]
    line = utility._missing_line(utility._missing([old], reported), [{"method": "sparta", "seconds": 3600.0}])
    assert line.startswith("missing: 1 planned cells have not run yet, 1 of them only to keep their selected rows "
                           "(about 1.0 h")


def test_an_invocation_keeps_the_recorded_runs_of_the_methods_it_leaves_out():
    records = [_record("sparta", 1.0, 0, 0.6), _record("bitfit", 1.0, 0, 0.5), _record("bitfit", 2.0, 0, 0.5, kind="tune"),
               _record("oracle", 1.0, 0, 0.6, kind="overlap"), _record("sparta", 1.0, 0, 0.6, kind="warmup"),
               _record("oracle", 1.0, 0, 0.7)]
    kept = utility.records_of_methods_not_run(records, ["bitfit", "oracle"])
    assert kept == [records[1], records[2], records[5]]  # the overlap runs are SPARTA's: it plans them
    assert utility.records_of_methods_not_run(records, ["bitfit", "oracle", "sparta"]) == records
    # the same ownership for the last report's missing cells (old string entries and structured ones)
    missing = ["overlap oracle eps=1 seed=0 granularity=row", "main oracle eps=1 seed=0",
               {"cell": "main bitfit eps=8 seed=1", "kind": "main", "method": "bitfit", "rerun_for_rows": False},
               "rate_ablation: all of its cells (the profile gained it after the last benchmark run)"]
    kept = utility.missing_of_methods_not_run(missing, ["bitfit", "oracle"])
    assert [e["cell"] for e in kept] == ["main oracle eps=1 seed=0", "main bitfit eps=8 seed=1"]


# the standard profile's analyses the weak one leaves out, and what differs by design
STANDARD_ONLY = ("public_model", "methods", "densities", "more_seeds", "warmup_ablation", "rate_ablation", "row_oracle",
                 "stronger_public_model_profile")


def test_standard_profile_is_the_regime_the_issue_asks_for():
    profile = utility.PROFILES["standard"]
    train = profile["limit_train"] - round(0.1 * profile["limit_train"])  # 10% held out for validation
    assert train >= 5000 and profile["epochs"] >= 20
    assert 1 / profile["epochs"] <= 0.10  # the selection epoch's share of the steps
    assert len(profile["lr_grid"]) >= 3 and profile["bracket_lr"]
    assert set(profile["epsilons"]) == {1.0, 2.0, 8.0}
    assert utility.seeds_of(profile, "sparta") == (0, 1, 2, 3, 4) and utility.seeds_of(profile, "last") == (0, 1, 2)
    from sparta_tf.models import pretrained

    for variant in ("standard", "standard-weak"):
        for track, name in utility.PROFILES[variant]["public_model"].items():
            assert name in pretrained.available(), f"{name} for {track} ({variant}) is not shipped"
    weak = utility.PROFILES["standard-weak"]
    assert {k: v for k, v in weak.items() if k not in STANDARD_ONLY} == {
        k: v for k, v in profile.items() if k not in STANDARD_ONLY}
    assert weak["stronger_public_model_profile"] == "standard"


def test_benchmark_cells_are_seed_major_so_a_partial_run_has_comparable_cells(tmp_path):
    profile = utility.PROFILES["standard"]
    methods = ["sparta", "all", "last"]  # sparta and all run more seeds than last
    cells = [c for c in utility.benchmark_cells({"training": {}, "privacy": {}}, profile, methods,
                                                {m: 0.01 for m in methods}, str(tmp_path)) if c.kind == "main"]
    seeds = [c.seed for c in cells]
    assert seeds == sorted(seeds)  # every method and epsilon has seed k before any has seed k + 1
    first = cells[: len(methods) * len(profile["epsilons"])]
    assert {(c.method, c.epsilon) for c in first} == {(m, e) for m in methods for e in profile["epsilons"]}
    assert {c.method for c in cells if c.seed == max(profile["more_seeds"])} == {"sparta", "all"}


def test_ablations_run_after_every_methods_seeds_and_before_the_extra_seeds(tmp_path):
    profile = utility.PROFILES["standard"]
    methods = ["sparta", "all", "mp", "last"]
    cells = utility.benchmark_cells({"training": {}, "privacy": {}, "method": {}}, profile, methods,
                                    {m: 0.01 for m in methods}, str(tmp_path))
    kinds = [c.kind for c in cells]
    extra = [i for i, c in enumerate(cells) if c.kind == "main" and c.seed not in profile["seeds"]]
    ablations = [i for i, kind in enumerate(kinds) if kind != "main"]
    base_seeds = [i for i, c in enumerate(cells) if c.kind == "main" and c.seed in profile["seeds"]]
    assert extra and ablations and {"density", "warmup", "overlap"} <= set(kinds)
    assert max(base_seeds) < min(ablations) and max(ablations) < min(extra)
    assert {(c.method, c.epsilon, c.seed) for c in cells if c.kind == "main"} == {
        (m, e, s) for m in methods for e in profile["epsilons"] for s in utility.seeds_of(profile, m)}


def test_recorded_runs_are_restored_into_a_fresh_work_dir_and_not_recomputed(tmp_path, fake_train, monkeypatch):
    monkeypatch.setattr(utility, "validate_config", lambda config: config)
    work_dir, out_dir = str(tmp_path / "runs"), str(tmp_path / "results")
    config = utility.cell_config({"data": {}, "model": {}, "privacy": {}, "training": {}}, "sparta", 2.0, 0, 0.01,
                                 0.2, os.path.join(work_dir, "tune", "sparta", "lr0.01"))
    results = dict(utility.run_cell(config, "sparta"), history={"val_accuracy": [0.4, 0.6]})
    record = utility._record(results, "sparta", 2.0, 0, 0.01, 0.2, "tune")
    foreign = dict(record, config=dict(record["config"], output_dir=str(tmp_path / "elsewhere" / "x")))
    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "t-p.json"), "w") as f:
        json.dump({"runs": [record, foreign, dict(record, config=None)]}, f)
    import shutil

    shutil.rmtree(work_dir)  # a fresh checkout: runs/ is not committed
    recorded = utility.recorded_runs(out_dir, "t-p")
    assert utility.restore_recorded_runs(recorded, work_dir, "t-p.json") == 1  # only the one made under work_dir
    assert not os.path.exists(tmp_path / "elsewhere")
    again = utility.run_cell(config, "sparta")
    assert len(fake_train) == 1  # restored, not trained again
    assert again["test_accuracy"] == record["test_accuracy"]
    assert utility._val_accuracy(again) == 0.6
    assert again["history"]["val_accuracy"] == [0.4, 0.6]  # the whole curve, for the phase analysis
    assert utility.restore_recorded_runs(recorded, work_dir, "t-p.json") == 0  # idempotent
    changed = utility.cell_config(config, "sparta", 2.0, 0, 0.01, 0.5, config["output_dir"])  # another density
    utility.run_cell(changed, "sparta")
    assert len(fake_train) == 2  # a restored run with another configuration is run again


def test_a_runs_selected_rows_are_recorded_and_survive_a_checkout_without_runs(tmp_path, fake_train, monkeypatch):
    """The row-overlap analysis needs each run's selected rows; runs/ is not committed, the JSON is."""
    import numpy as np
    from trainers import run

    trained = run.train

    def train_with_mask(config):
        results = trained(config)
        os.makedirs(os.path.join(config["output_dir"], "mask"))
        np.savez(os.path.join(config["output_dir"], "mask", "mask.npz"),
                 **{"conv/kernel:0::rows": np.array([3, 1]), "head/bias:0::dense": np.zeros(0)})
        return results

    monkeypatch.setattr(run, "train", train_with_mask)
    monkeypatch.setattr(utility, "validate_config", lambda config: config)
    work_dir = str(tmp_path / "runs")
    config = utility.cell_config({"data": {}, "model": {}, "privacy": {}, "training": {}}, "sparta", 2.0, 1, 0.01,
                                 0.2, os.path.join(work_dir, "sparta", "eps2", "seed1"))
    record = utility._record(utility.run_cell(config, "sparta"), "sparta", 2.0, 1, 0.01, 0.2, "main")
    assert record["selected_rows"] == {"conv/kernel:0": [1, 3]}
    import shutil

    shutil.rmtree(work_dir)
    assert utility.restore_recorded_runs([json.loads(json.dumps(record))], work_dir, "t-p.json") == 1
    again = utility._record(utility.run_cell(config, "sparta"), "sparta", 2.0, 1, 0.01, 0.2, "main")
    assert len(fake_train) == 1 and again["selected_rows"] == {"conv/kernel:0": [1, 3]}


def test_report_keeps_the_overlap_table_it_can_no_longer_compute_and_marks_it(tmp_path):
    profile = utility.PROFILES["smoke"]
    heading = "## How much of the oracle's choice SPARTA's private selection recovers"
    records = [_record("sparta", 8.0, 0, 0.6), _record("oracle", 8.0, 0, 0.62, kind="overlap")]  # no rows, no runs/
    stored = {"profile": utility._comparable(profile), "delta": utility.DELTA, "elapsed_s": 5.0, "runs": records}
    (tmp_path / "cifar10-transfer-smoke.json").write_text(json.dumps(stored))
    args = ["--track", "cifar10-transfer", "--profile", "smoke", "--data-dir", str(tmp_path), "--out-dir",
            str(tmp_path), "--report-only"]
    assert utility.main(args) == 0
    report = tmp_path / "cifar10-transfer-smoke.md"
    assert "re-runs those overlap pairs to restore this table" in report.read_text()
    table = "| ε | rows shared |\n|---:|---:|\n| 8 | 90.0% (chance 20%) |"
    report.write_text(report.read_text().replace(heading + "\n", heading + "\n\n" + table + "\n"))
    for _ in range(2):  # carried once, not once more per rewrite
        assert utility.main(args) == 0
        section = report.read_text().split(heading)[1].split("\n## ")[0]
        assert table in section and section.count("Carried over unchanged") == 1
    # A pair re-run with its rows while another pair still has none: the section as last written stands
    # (not a table of the re-run pairs alone) until every pair has its rows again.
    rows = {"conv/kernel:0": [0, 1]}
    stored["runs"] += [_record("sparta", 1.0, 0, 0.5) | {"selected_rows": rows},
                       _record("oracle", 1.0, 0, 0.5, kind="overlap") | {"selected_rows": rows}]
    (tmp_path / "cifar10-transfer-smoke.json").write_text(json.dumps(stored))
    assert utility.main(args) == 0
    section = report.read_text().split(heading)[1].split("\n## ")[0]
    assert table in section and "| 1 | 100.0%" not in section
    stored["runs"][:2] = [r | {"selected_rows": {"conv/kernel:0": [0, 2]}} for r in stored["runs"][:2]]
    (tmp_path / "cifar10-transfer-smoke.json").write_text(json.dumps(stored))
    assert utility.main(args) == 0
    section = report.read_text().split(heading)[1].split("\n## ")[0]
    assert "| 1 | 100.0%" in section and "| 8 | 100.0%" in section and "Carried over" not in section


def test_report_names_the_methods_an_invocation_left_out_and_keeps_them_on_rewrite(tmp_path):
    profile = utility.PROFILES["standard"]
    record = {"kind": "tune", "method": "sparta", "target_epsilon": 2.0, "seed": 0, "learning_rate": 0.01,
              "density": 0.2, "private": True, "epsilon": 2.0, "test_accuracy": 0.5, "val_accuracy": 0.5,
              "trainable_fraction": 0.2, "seconds": 1.0, "run_dir": None, "config": None}
    budgets = {"2": {"steps_share": 0.05, "epsilon_increment_share": 0.04, "epsilon_marginal_share": 0.03,
                     "epsilon_alone": 0.6, "epsilon": 2.0}}
    report = utility.Report(str(tmp_path), "cifar10-transfer-standard", profile, 0.0, ["last", "oracle", "dpsgd_grad"], budgets)
    utility._write(report, [record], None)
    text = (tmp_path / "cifar10-transfer-standard.md").read_text()
    assert "not run yet" in text
    assert ("last (tuning, then 9 cells: eps 1, 2, 8 x seeds 0-2); oracle (tuning, then 9 cells: eps 1, 2, 8 x "
            "seeds 0-2); dpsgd_grad (tuning, then 15 cells: eps 1, 2, 8 x seeds 0-4); 33 cells in all, besides their "
            "tuning runs") in text
    assert "| 2 | 5.0% | 3.0% | 4.0% | 0.6 |" in text
    (tmp_path / "cifar10-transfer-standard.md").unlink()
    assert utility.rewrite_report(str(tmp_path), "cifar10-transfer-standard", profile) == 0
    assert "last (tuning, then 9 cells" in (tmp_path / "cifar10-transfer-standard.md").read_text()
    assert "| 2 | 5.0% |" in (tmp_path / "cifar10-transfer-standard.md").read_text()


def test_tuning_runs_the_middle_rate_of_every_method_first():
    cells = utility.tuning_cells({"training": {}, "privacy": {}}, utility.PROFILES["standard"], ["sparta", "all"], "/w")
    grids = {"sparta": (0.01, 0.03, 0.1), "all": (0.01, 0.03, 0.1)}
    ordered = utility.middle_rates_first(cells + [utility.Cell("tune", "all", 2.0, 0, 0.3, 0.2, {})], grids)
    assert [(c.method, c.lr) for c in ordered] == [("sparta", 0.03), ("all", 0.03), ("sparta", 0.01), ("all", 0.01),
                                                    ("sparta", 0.1), ("all", 0.1), ("all", 0.3)]


def test_epsilons_option_restricts_the_cells_and_rejects_epsilons_outside_the_profile(tmp_path):
    profile = utility.PROFILES["standard"]
    cells, others = utility.split_by_epsilon(utility.benchmark_cells(
        {"training": {}, "privacy": {}}, profile, ["sparta"], {"sparta": 0.03}, str(tmp_path)), [2.0])
    assert {c.epsilon for c in cells if c.kind == "main"} == {2.0}
    assert {c.kind for c in cells} == {"main", "density", "warmup", "rate", "overlap"}  # the analyses always run
    assert {c.epsilon for c in others} == {1.0, 8.0} and {c.kind for c in others} == {"main"}
    with pytest.raises(SystemExit):
        utility.main(["--track", "cifar10-transfer", "--profile", "standard", "--data-dir", str(tmp_path),
                      "--epsilons", "3"])


@pytest.fixture
def offline_main(tmp_path, fake_train, monkeypatch):
    """``utility.main`` on the quick profile with the trainer, data and planning faked: what is under
    test is which cells run and which runs the report keeps."""
    monkeypatch.setattr(utility, "validate_config", lambda config: config)
    monkeypatch.setattr(utility, "base_config", lambda *args: {"data": {}, "model": {}, "privacy": {}, "training": {}})
    monkeypatch.setattr(utility, "planned_selection_budgets", lambda *args: {})

    def main(*args):
        return utility.main(["--track", "cifar10-transfer", "--profile", "quick", "--data-dir", str(tmp_path),
                             "--work-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "results"),
                             "--methods", "sparta", "all", *args])
    return main


def _reported(tmp_path) -> dict:
    return json.loads((tmp_path / "results" / "cifar10-transfer-quick.json").read_text())


def test_an_epsilons_run_keeps_the_other_epsilons_recorded_runs_and_lists_their_missing_cells(
        tmp_path, fake_train, offline_main):
    assert offline_main("--epsilons", "2") == 0
    trained = len(fake_train)
    eps2 = sorted((r["method"], r["seed"]) for r in _reported(tmp_path)["runs"]
                  if r["kind"] == "main" and r["target_epsilon"] == 2.0)
    assert eps2 == [(m, s) for m in ("all", "sparta") for s in PROFILE["seeds"]]
    assert offline_main("--epsilons", "8") == 0
    assert len(fake_train) - trained == 2 * len(PROFILE["seeds"])  # only the epsilon-8 cells ran
    stored = _reported(tmp_path)
    main_runs = {(r["method"], r["target_epsilon"], r["seed"]) for r in stored["runs"] if r["kind"] == "main"}
    assert main_runs == {(m, e, s) for m in ("sparta", "all") for e in (2.0, 8.0) for s in PROFILE["seeds"]}
    assert sorted(e["cell"] for e in stored["missing"]) == sorted(f"main {m} eps=1 seed={s}" for m in ("sparta", "all")
                                                              for s in PROFILE["seeds"])


def test_a_run_stopped_while_tuning_keeps_the_recorded_benchmark_runs_in_the_report(
        tmp_path, fake_train, offline_main, monkeypatch):
    assert offline_main("--epsilons", "2") == 0
    recorded = [r for r in _reported(tmp_path)["runs"] if r["kind"] != "tune"]
    redo = tmp_path / "runs" / "cifar10-transfer-quick" / "tune" / "all" / "lr0.1"
    _forget(tmp_path, redo)
    from trainers import run

    def killed(config):
        raise KeyboardInterrupt  # the run is stopped during the tuning run it has to redo
    monkeypatch.setattr(run, "train", killed)
    with pytest.raises(KeyboardInterrupt):
        offline_main("--epsilons", "2")
    kept = [r for r in _reported(tmp_path)["runs"] if r["kind"] != "tune"]
    assert kept == [r for r in recorded if r["run_dir"] != str(redo)] and len(kept) >= 8


def _forget(tmp_path, run_dir) -> None:
    """A recorded run to redo: gone from the work directory and from the report it would be restored from."""
    os.remove(run_dir / "results.json")
    stored = _reported(tmp_path)
    stored["runs"] = [r for r in stored["runs"] if r["run_dir"] != str(run_dir)]
    (tmp_path / "results" / "cifar10-transfer-quick.json").write_text(json.dumps(stored))


def test_a_run_stopped_at_its_first_new_cell_still_reports_every_cached_cell_after_it(
        tmp_path, fake_train, offline_main, monkeypatch):
    assert offline_main("--epsilons", "2") == 0
    redo = tmp_path / "runs" / "cifar10-transfer-quick" / "sparta" / "eps2" / "seed1"  # early in the plan
    recorded = [r for r in _reported(tmp_path)["runs"] if r["run_dir"] != str(redo)]
    _forget(tmp_path, redo)
    from trainers import run

    def killed(config):
        raise KeyboardInterrupt
    monkeypatch.setattr(run, "train", killed)
    with pytest.raises(KeyboardInterrupt):
        offline_main("--epsilons", "2")
    stored = _reported(tmp_path)
    assert sorted(map(json.dumps, stored["runs"])) == sorted(map(json.dumps, recorded))
    assert any(r["kind"] == "density" for r in stored["runs"])  # planned after the stopped cell
    assert "main sparta eps=2 seed=1" in [e["cell"] for e in stored["missing"]]


def test_killing_the_benchmark_process_ends_its_workers(tmp_path):
    import signal
    import subprocess
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {os.path.dirname(utility.__file__)!r})\n"
        "import utility\n"
        "if __name__ == '__main__':\n"
        "    with utility.CellRunner(2) as runner:\n"
        "        futures = [runner._pool.submit(time.sleep, 120) for _ in range(2)]\n"
        "        time.sleep(3)\n"
        "        print(' '.join(map(str, runner._pool._processes)), flush=True)\n"
        "        time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(workers) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    deadline = time.time() + 60  # generous for a loaded machine; the workers' own task lasts 120 s
    while any(alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(alive(pid) for pid in workers)


def test_a_run_of_fewer_methods_keeps_the_recorded_runs_of_the_others(tmp_path, fake_train, offline_main):
    assert offline_main("--epsilons", "2") == 0
    full = [r for r in _reported(tmp_path)["runs"] if r["method"] == "all"]
    assert offline_main("--epsilons", "2", "--methods", "sparta") == 0  # the last --methods wins
    stored = _reported(tmp_path)
    assert [r for r in stored["runs"] if r["method"] == "all"] == full and len(full) >= 4
    assert stored["methods_not_run"] == [m for m in PROFILE.get("methods", utility.METHODS) if m != "sparta"]
    # all's cells at epsilon 1 and 8 are still missing: the sparta-only run keeps the last report's word on them
    all_missing = sorted(f"main all eps={e:g} seed={s}" for e in (1, 8) for s in PROFILE["seeds"])
    assert sorted(e["cell"] for e in stored["missing"] if e["method"] == "all") == all_missing
    assert sorted(e["cell"] for e in stored["missing"] if e["method"] == "sparta") == [
        a.replace("all", "sparta") for a in all_missing]
    report = (tmp_path / "results" / "cifar10-transfer-quick.md").read_text()
    assert "their recorded runs and missing cells kept as the last report had them: all\n" in report
    assert ": all" not in report.split("not run yet (methods without tuning runs or cells")[1].splitlines()[0]
    assert "learning rates: sparta 0.1, all 0.1" in report  # the methods' order, not the records'


def test_an_epsilons_run_reports_the_ceilings_new_runs_in_every_column(tmp_path, fake_train, offline_main,
                                                                        monkeypatch):
    """The non-private ceiling has one run per seed, shown in every ε column: the columns an
    ``--epsilons`` run leaves out show the runs it made, not only those cached when it started."""
    from trainers import run

    monkeypatch.setattr(utility, "_nonprivate", lambda config: dict(run.train(config), private=False))
    assert offline_main("--epsilons", "2", "--methods", "sparta", "nonprivate") == 0
    stored = _reported(tmp_path)
    ceiling = {(r["target_epsilon"], r["seed"]) for r in stored["runs"] if r["method"] == "nonprivate"
               and r["kind"] == "main"}
    assert ceiling == {(e, s) for e in PROFILE["epsilons"] for s in PROFILE["seeds"]}
    assert not [e for e in stored["missing"] if e["method"] == "nonprivate"]


def test_selection_budgets_follow_the_profile_not_the_invocations_methods(monkeypatch):
    """An invocation without SPARTA (``--methods random``) keeps SPARTA's runs in the report, so it
    must keep the section on SPARTA's selection epoch too (it had dropped it)."""
    import utility_analysis
    from trainers import run

    monkeypatch.setattr(utility, "validate_config", lambda config: config)
    monkeypatch.setattr(run, "dry_run", lambda config, **_: SimpleNamespace(to_json=lambda: config))
    monkeypatch.setattr(utility_analysis, "selection_budget", lambda plan: plan["privacy"]["target_epsilon"])
    base = {"data": {}, "model": {}, "privacy": {}, "training": {}}
    standard = utility.PROFILES["standard"]
    assert utility.planned_selection_budgets(base, standard) == {"1": 1.0, "2": 2.0, "8": 8.0}
    assert utility.planned_selection_budgets(base, dict(standard, methods=("all", "random"))) == {}
