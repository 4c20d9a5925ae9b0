"""The BandMF benchmark's rate bracket (``benchmarks/bands.py``): from today's rate to its neighbours on the
ladder until the best has a worse rate on both sides, as the standard profile bracketed its rates."""

import os
import sys

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
