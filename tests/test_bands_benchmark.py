"""The BandMF benchmark's rate bracket (``benchmarks/bands.py``): from today's rate to its neighbours on the
ladder until the best has a worse rate on both sides, as the standard profile bracketed its rates."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bands  # noqa: E402


def _search(start, accuracy):
    tried = {}
    rate = start
    while rate is not None:
        tried[rate] = accuracy(rate)
        rate = bands.next_rate(tried)
    return tried


def test_a_peak_at_todays_rate_costs_its_two_neighbours():
    tried = _search(0.1, lambda r: -abs(r - 0.1))
    assert sorted(tried) == [0.03, 0.1, 0.3]


def test_the_search_walks_toward_a_peak_elsewhere_and_stops_once_it_is_bracketed():
    tried = _search(0.1, lambda r: -abs(r - 0.01))
    assert sorted(tried) == [0.003, 0.01, 0.03, 0.1]  # 0.3 is never needed: 0.03 already beat 0.1
    assert max(tried, key=tried.get) == 0.01


def test_the_ladders_end_bounds_the_search_and_ties_go_to_the_smaller_rate():
    assert sorted(_search(0.3, lambda r: r)) == [0.1, 0.3, 1.0]
    tried = {0.03: 0.5, 0.1: 0.5, 0.01: 0.4, 0.3: 0.4}
    assert bands.next_rate(tried) is None and max(tried, key=lambda r: (tried[r], -r)) == 0.03


def _pids(jobs):
    done = {}

    def chain(method, call):
        done[method] = [call(os.getpid) for _ in range(2)]

    bands.side_by_side(("sparta", "all"), jobs, chain, prepare=(os.getpid,))
    return done


def test_one_job_runs_every_method_in_this_process():
    assert _pids(1) == {"sparta": [os.getpid()] * 2, "all": [os.getpid()] * 2}


def test_two_jobs_run_each_run_in_a_worker_process():
    done = _pids(2)
    assert set(done) == {"sparta", "all"}
    workers = {pid for pids in done.values() for pid in pids}
    assert os.getpid() not in workers and 1 <= len(workers) <= 2


def test_a_failed_run_stops_the_benchmark_with_its_error():
    def chain(method, call):
        call(abs, -1) if method == "all" else call(int, "not a number")

    try:
        bands.side_by_side(("sparta", "all"), 2, chain)
    except ValueError as error:
        assert "not a number" in str(error)
    else:
        raise AssertionError("the failed run's error was swallowed")


def _fake_benchmark(monkeypatch, tmp_path, best_rate, standard=None, fail_bracket=False, jobs=1):
    """bands.main with its runs faked, in this process (``jobs`` > 1: its workers are threads): validation
    accuracy peaks at ``best_rate[method]``; ``standard``: (method, epsilon, seed, rate) -> a standard-profile
    run to reuse. Returns the runs as called, (kind, method, epsilon, seed, rate, bands), and the saved state."""
    import concurrent.futures
    import json

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor",
                        lambda workers, **spawning: concurrent.futures.ThreadPoolExecutor(workers))

    called = []

    def run_record(base, method, epsilon, seed, rate, bands_, work_dir, kind):
        called.append((kind, method, epsilon, seed, rate, bands_))
        if fail_bracket and kind == "tune":
            raise RuntimeError("the bracket's run failed")
        accuracy = 0.8 - abs(rate - best_rate[method]) - (0.01 if bands_ == 1 else 0.0)
        return {"kind": kind, "method": method, "target_epsilon": epsilon, "seed": seed, "learning_rate": rate,
                "bands": bands_, "epsilon": epsilon, "noise_multiplier": 1.0, "test_accuracy": accuracy,
                "val_accuracy": accuracy, "minutes": 1.0}

    monkeypatch.setattr(bands, "run_record", run_record)
    monkeypatch.setattr(bands, "chosen_bands", lambda base, method, epsilon, work_dir: (4, [
        {"bands": 1, "noise_multiplier": 1.0, "ratio": 1.0}, {"bands": 4, "noise_multiplier": 2.0, "ratio": 0.8}]))
    monkeypatch.setattr(bands.utility, "base_config", lambda *args: {})
    monkeypatch.setattr(bands.utility, "ensure_pretrained", lambda base: None)
    monkeypatch.setattr(bands.tuning, "today", lambda method, epsilon, seeds: {s: 0.7 for s in seeds})
    monkeypatch.setattr(bands, "standard_run", lambda *key: (standard or {}).get(key))
    bands.main(["--work-dir", str(tmp_path), "--out-dir", str(tmp_path), "--jobs", str(jobs)])
    return called, json.loads((tmp_path / f"{bands.NAME}.json").read_text())


def test_dp_sgd_runs_at_bandmfs_rate_wherever_the_bracket_moved_it(monkeypatch, tmp_path):
    reused = {"test_accuracy": 0.5, "val_accuracy": 0.5, "epsilon": 2.0}
    called, state = _fake_benchmark(monkeypatch, tmp_path, {"sparta": 0.1, "all": 0.1},
                                    standard={("all", 2.0, 0, 0.1): reused})
    controls = [c for c in called if c[0] == "control"]
    assert {c[1] for c in controls} == {"all"}  # sparta's bracket kept today's rate: nothing to control
    assert all(c[4] == 0.1 and c[5] == 1 for c in controls)  # BandMF's rate, one band
    cells = {(e, s) for e in bands.EPSILONS for s in bands.SEEDS}
    assert {(c[2], c[3]) for c in controls} == cells - {(2.0, 0)}  # the standard run of that cell is reused
    recorded = [r for r in state["runs"] if r["kind"] == "control"]
    assert len(recorded) == len(cells) and sum(r.get("reused", False) for r in recorded) == 1
    report = (tmp_path / f"{bands.NAME}.md").read_text()
    assert "the rate held fixed" in report and "| all | 8 | 0.1 |" in report and "Missing" not in report


def test_a_rerun_runs_no_control_twice_and_reports_the_missing_ones(monkeypatch, tmp_path):
    _fake_benchmark(monkeypatch, tmp_path, {"sparta": 0.1, "all": 0.1})
    called, _ = _fake_benchmark(monkeypatch, tmp_path, {"sparta": 0.1, "all": 0.1})
    assert called == []
    state = {"bands": {}, "runs": [{"kind": "tune", "method": "all", "target_epsilon": 2.0, "seed": 0,
                                    "learning_rate": rate, "val_accuracy": accuracy, "minutes": 1.0}
                                   for rate, accuracy in ((0.03, 0.7), (0.1, 0.8), (0.3, 0.6))]}
    report = bands.report(state, ("all",), (8.0,), (0,))
    assert "control all eps 8 seed 0" in report


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_failed_bracket_stops_the_benchmark_instead_of_leaving_the_controls_waiting(monkeypatch, tmp_path, jobs):
    import threading

    errors = []

    def benchmark():
        try:
            _fake_benchmark(monkeypatch, tmp_path, {"sparta": 0.1, "all": 0.1}, fail_bracket=True, jobs=jobs)
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=benchmark, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the benchmark hung: its controls wait for a bracket that failed"
    assert errors and "bracket's run failed" in str(errors[0])


def test_the_standard_profiles_run_of_a_cell_is_found_by_its_rate(tmp_path):
    import json

    path = tmp_path / "standard.json"
    runs = [{"kind": "tune", "method": "all", "target_epsilon": 2.0, "seed": 0, "learning_rate": 0.1,
             "density": 0.2, "test_accuracy": 0.74},
            {"kind": "main", "method": "all", "target_epsilon": 2.0, "seed": 0, "learning_rate": 0.03,
             "density": 0.2, "test_accuracy": 0.73}]
    path.write_text(json.dumps({"runs": runs}))
    assert bands.standard_run("all", 2.0, 0, 0.1, str(path))["test_accuracy"] == 0.74
    assert bands.standard_run("all", 8.0, 0, 0.1, str(path)) is None
    assert bands.standard_run("all", 2.0, 0, 0.1, str(tmp_path / "absent.json")) is None
