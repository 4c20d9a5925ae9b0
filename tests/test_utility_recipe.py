"""Utility benchmark, issue 50's recipe profile: augmult + EMA runs set beside today's recipe, paired by seed."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import utility  # noqa: E402
import utility_recipe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = utility.PROFILES["recipe"]
STANDARD = utility.PROFILES["standard"]


def test_recipe_profile_is_the_standard_track_with_augmult_and_ema_on_the_issues_cells():
    assert set(RECIPE["methods"]) == {"sparta", "all", "mp"}
    assert RECIPE["epsilons"] == (2.0, 8.0) and len(RECIPE["seeds"]) >= 3 and RECIPE["today_profile"] == "standard"
    assert RECIPE["training"]["augmult"] >= 2 and 0 < RECIPE["training"]["ema"] < 1
    for key in ("epochs", "batch_size", "limit_train", "limit_test", "public_model", "model", "tune_epsilon"):
        assert RECIPE[key] == STANDARD[key], key
    base = utility.base_config("cifar10-transfer", RECIPE, "/work/shared/data", "", "/w") if os.path.exists(
        "/work/shared/data/cifar10-jpg.tar.gz") else None
    if base is not None:
        today = utility.base_config("cifar10-transfer", STANDARD, "/work/shared/data", "", "/w")
        assert {k: v for k, v in base["training"].items() if k not in RECIPE["training"]} == today["training"]
        assert base["training"]["augmult"] == RECIPE["training"]["augmult"]


def test_recipe_grids_start_at_each_methods_standard_rate_and_its_ladder_neighbours():
    with open(os.path.join(ROOT, "benchmarks", "results", "cifar10-transfer-standard.json")) as f:
        tuned = json.load(f)["learning_rates"]
    for method in RECIPE["methods"]:
        rung = utility.LR_LADDER.index(tuned[method])
        assert utility.lr_grid_of(RECIPE, method) == utility.LR_LADDER[rung - 1:rung + 2]
    assert utility.lr_grid_of(STANDARD, "mp") == (0.01, 0.03, 0.1)  # one grid for every method


def test_recipe_tuning_runs_each_methods_own_grid_with_the_recipes_training_options(tmp_path, monkeypatch):
    base = {"data": {}, "model": {}, "privacy": {}, "training": {"augmult": 4, "ema": 0.999}}
    seen = []

    class Runner:
        def run(self, tasks, on_result=None):
            seen.extend(cell for _, cell in tasks)
            return [{"test_accuracy": 0.5, "history": {"val_accuracy": [cell.lr if cell.lr < 0.2 else 0.0]}}
                    for _, cell in tasks]

    cells, _ = utility.tune(Runner(), base, RECIPE, list(RECIPE["methods"]), str(tmp_path))
    tried = {m: sorted({c.lr for c in cells if c.method == m}) for m in RECIPE["methods"]}
    # sparta and mp: 0.1 best of (0.03, 0.1, 0.3), interior; all: 0.1 at the top edge of (0.01, 0.03, 0.1): + 0.3
    assert tried == {"sparta": [0.03, 0.1, 0.3], "all": [0.01, 0.03, 0.1, 0.3], "mp": [0.03, 0.1, 0.3]}
    assert all(c.config["training"]["augmult"] == 4 and c.config["training"]["ema"] == 0.999 for c in cells)
    first = seen[:3]  # the middle of each method's own grid first
    assert [(c.method, c.lr) for c in first] == [("all", 0.03), ("sparta", 0.1), ("mp", 0.1)]


def test_a_run_with_a_weight_average_records_and_restores_both_accuracies(tmp_path, monkeypatch):
    from trainers import run

    def train(config):
        os.makedirs(config["output_dir"], exist_ok=True)
        return {"method": "sparta", "test_accuracy": 0.8, "test_weights": "ema", "test_accuracy_raw_weights": 0.7,
                "test_accuracy_ema_weights": 0.8, "trainable_fraction": 0.2}

    monkeypatch.setattr(run, "train", train)
    monkeypatch.setattr(utility, "validate_config", lambda config: config)
    work_dir = str(tmp_path / "runs")
    config = utility.cell_config({"data": {}, "model": {}, "privacy": {}, "training": {"ema": 0.999}}, "sparta",
                                 2.0, 0, 0.1, 0.2, os.path.join(work_dir, "sparta", "eps2", "seed0"))
    record = utility._record(utility.run_cell(config, "sparta"), "sparta", 2.0, 0, 0.1, 0.2, "main")
    assert (record["test_accuracy_raw_weights"], record["test_accuracy_ema_weights"]) == (0.7, 0.8)
    import shutil

    shutil.rmtree(work_dir)  # a fresh checkout
    assert utility.restore_recorded_runs([record], work_dir, "r.json") == 1
    restored = utility._record(utility.cached_result(config), "sparta", 2.0, 0, 0.1, 0.2, "main")
    assert restored["test_accuracy_raw_weights"] == 0.7 and restored["test_accuracy_ema_weights"] == 0.8


def _run(method, eps, seed, accuracy, raw=None, kind="main", seconds=600.0, recipe=False, epochs=20):
    training = {"epochs": epochs, "learning_rate": 0.1, "head_learning_rate": 1.0, "seed": seed}
    if recipe:
        training.update(augmult=4, ema=0.999, learning_rate=0.3, head_learning_rate=3.0)
    run_dir = f"/runs/{'recipe' if recipe else 'standard'}/{kind}/{method}/{eps}/{seed}"
    record = {"kind": kind, "method": method, "target_epsilon": eps, "seed": seed, "learning_rate": 0.1,
              "density": 0.2, "private": method != "nonprivate", "epsilon": eps, "test_accuracy": accuracy,
              "val_accuracy": accuracy, "trainable_fraction": 0.2, "seconds": seconds, "run_dir": run_dir,
              "config": {"training": training, "output_dir": run_dir, "data": {"path": "d"}}}
    if raw is not None:
        record.update(test_weights="ema", test_accuracy_raw_weights=raw, test_accuracy_ema_weights=accuracy)
    return record


def test_recipe_table_pairs_today_augmult_and_ema_by_seed_with_t_intervals():
    today = ([_run("sparta", 2.0, s, a) for s, a in enumerate((0.70, 0.72, 0.74, 0.99))]  # seed 3: not in the plan
             + [_run("sparta", 1.0, s, 0.6) for s in range(3)])  # nor epsilon 1
    recipe = [_run("sparta", 2.0, s, ema, raw, recipe=True) for s, (ema, raw) in
              enumerate(((0.75, 0.73), (0.76, 0.75), (0.80, 0.76)))]
    runs, unlike = utility_recipe.variant_runs(today, recipe, ["sparta"], (2.0, 8.0), (0, 1, 2))
    assert unlike == {}
    table = utility_recipe.recipe_table(runs, ["sparta"]).splitlines()
    assert len(table) == 3  # the header, its rule and one row: sparta at epsilon 2
    row = table[2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["sparta", "2", "72.00 ± 2.00 (3)", "74.67 ± 1.53 (3)", "77.00 ± 2.65 (3)"]
    # augmult - today: +3, +3, +2 -> mean 2.67, sd 0.577, t(0.975, 2) = 4.303: half-width 1.43, excludes 0
    assert cells[5] == "+2.67 [+1.23, +4.10] (n=3) ▲"
    # augmult + EMA - today: +5, +4, +6; EMA - raw: +2, +1, +4 (half-width 3.79: includes 0, no claim)
    assert cells[6] == "+5.00 [+2.52, +7.48] (n=3) ▲"
    assert cells[7].startswith("+2.33 [") and cells[7].endswith("(n=3)")


def test_gap_to_nonprivate_and_cost_per_run_under_each_recipe():
    today = ([_run("sparta", 8.0, s, 0.78, seconds=600) for s in range(3)]
             + [_run("nonprivate", 8.0, s, 0.86, seconds=300) for s in range(3)])
    recipe = [_run("sparta", 8.0, s, 0.82, 0.80, seconds=1800, recipe=True) for s in range(3)]
    recipe.append(dict(recipe[0], kind="tune"))  # the tuning run is the (eps 2 / here 8, seed 0) cell: counted once
    runs, _ = utility_recipe.variant_runs(today, recipe, ["sparta"], (2.0, 8.0), (0, 1, 2))
    gap = utility_recipe.gap_table(runs, today).splitlines()[2]
    # non-private minus SPARTA, each on three seeds: 86 - 78 today, 86 - 80 augmult, 86 - 82 augmult + EMA
    assert gap == ("| 8 | 86.00 ± 0.00 (3) | +8.00 [+8.00, +8.00] (n=3) | +6.00 [+6.00, +6.00] (n=3) "
                   "| +4.00 [+4.00, +4.00] (n=3) |")
    cost = utility_recipe.cost_table(today, recipe, ["sparta"]).splitlines()[2]
    assert cost == "| sparta | 3 | 10.0 | 3 | 30.0 | 3.00x |"


def test_cells_that_differ_in_more_than_the_recipe_are_left_out_and_todays_absent_cells_listed():
    today = [_run("all", 2.0, s, 0.7) for s in range(2)]
    recipe = [_run("all", 2.0, 0, 0.8, 0.75, recipe=True), _run("all", 2.0, 1, 0.9, 0.8, recipe=True, epochs=40)]
    runs, unlike = utility_recipe.variant_runs(today, recipe, ["all"], (2.0,), (0, 1, 2))
    assert unlike == {("all", 2.0, 1): ["training.epochs"]}
    assert {r["seed"] for r in runs} == {0}
    assert utility_recipe.today_missing(today, ["all"], (2.0,), (0, 1, 2)) == [
        "all eps=2 seed=2", "nonprivate seed=0", "nonprivate seed=1", "nonprivate seed=2"]


def test_recipe_report_sets_the_new_recipe_beside_todays_report_in_the_same_folder(tmp_path):
    profile = utility.PROFILES["recipe-smoke"]
    today = [_run(m, 8.0, 0, a) for m, a in (("sparta", 0.6), ("all", 0.5), ("nonprivate", 0.9))]
    recipe = [_run("sparta", 8.0, 0, 0.7, 0.65, recipe=True)]
    for name, prof, runs in (("smoke", utility.PROFILES["smoke"], today), ("recipe-smoke", profile, recipe)):
        stored = {"profile": utility._comparable(prof), "delta": utility.DELTA, "elapsed_s": 5.0, "runs": runs,
                  "missing": []}
        (tmp_path / f"cifar10-transfer-{name}.json").write_text(json.dumps(stored))
    assert utility.main(["--track", "cifar10-transfer", "--profile", "recipe-smoke", "--data-dir", str(tmp_path),
                         "--out-dir", str(tmp_path), "--report-only"]) == 0
    report = (tmp_path / "cifar10-transfer-recipe-smoke.md").read_text()
    section = report.split("## Today's recipe against the new one")[1]
    assert "training.augmult = 2, training.ema = 0.999" in section
    assert "| sparta | 8 | 60.00 ± 0.00 (1) | 65.00 ± 0.00 (1) | 70.00 ± 0.00 (1) | +5.00 (1 pair, no interval)" in section
    assert "### SPARTA's gap to non-private fine-tuning" in section and "+30.00 (1 pair" in section
    assert "### Cost per run" in section
    assert "training.augmult = 2; training.ema = 0.999." in report  # the profile line names the recipe


@pytest.mark.parametrize("name", ["recipe", "recipe-smoke"])
def test_recipe_profiles_name_a_today_profile_with_the_same_cells(name):
    profile = utility.PROFILES[name]
    today = utility.PROFILES[profile["today_profile"]]
    assert set(profile["epsilons"]) <= set(today["epsilons"]) and set(profile["seeds"]) <= set(today["seeds"])
    assert set(utility.profile_methods(profile)) <= set(utility.profile_methods(today))
