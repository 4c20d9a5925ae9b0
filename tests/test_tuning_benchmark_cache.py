"""The tuning benchmark's cache (``benchmarks/tuning.py``): what it keeps of an unfinished tuning, so that a
fresh machine resumes it. What ``sparta-tune --resume`` reads is the contract: the state, every finished
candidate's score and ledger, and the model of the one candidate the release could still copy."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import tuning  # noqa: E402
from sparta_tf.tuning.procedure import best_index  # noqa: E402


def _tuning(out, scores, total=5, running=True):
    """A tuning directory: ``scores`` of its finished candidates (None: diverged), one more running."""
    os.makedirs(out)
    with open(os.path.join(out, "tuning.json"), "w") as f:
        json.dump({"draws": {"candidates": [{}] * total}, "split_key": 7}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write("{}")
    for index, score in enumerate(scores + ([None] if running else [])):
        path = os.path.join(out, "candidates", f"{index:03d}")
        os.makedirs(os.path.join(path, "checkpoints"))
        finished = index < len(scores)
        if finished and score is None:
            open(os.path.join(path, "diverged.json"), "w").write("{}")
        elif finished:
            json.dump({"tuning_score": score}, open(os.path.join(path, "results.json"), "w"))
            open(os.path.join(path, "model.keras"), "wb").write(bytes([index]) * 10)
        open(os.path.join(path, "ledger.json"), "w").write("{}")


def _models(cache):
    root = os.path.join(cache, "candidates")
    return sorted(c for c in os.listdir(root) if os.path.exists(os.path.join(root, c, "model.keras")))


def test_the_cache_keeps_every_finished_candidate_and_the_model_of_the_best_only(tmp_path):
    out, cache = str(tmp_path / "work" / "cell"), str(tmp_path / "cache" / "cell")
    scores = [0.4, None, 0.7, 0.7]  # a diverged one, and a tie: the first among equals is the release's
    _tuning(out, scores)
    assert tuning.save_cache(out, cache) == 4
    kept = sorted(os.listdir(os.path.join(cache, "candidates")))
    assert kept == ["000", "001", "002", "003"]  # not the running one
    assert _models(cache) == [f"{best_index(scores):03d}"] == ["002"]
    assert os.path.exists(os.path.join(cache, "candidates", "001", "diverged.json"))
    assert not os.path.exists(os.path.join(cache, "candidates", "000", "checkpoints"))
    json.dump({"tuning_score": 0.9}, open(os.path.join(out, "candidates", "004", "results.json"), "w"))
    open(os.path.join(out, "candidates", "004", "model.keras"), "wb").write(b"new best")
    tuning.save_cache(out, cache)
    assert _models(cache) == ["004"]  # the beaten model can no longer be released: dropped


def test_a_fresh_machine_restores_the_cache_and_resumes_after_the_last_finished_candidate(tmp_path):
    out, cache = str(tmp_path / "work" / "cell"), str(tmp_path / "cache" / "cell")
    _tuning(out, [0.5, 0.6])
    tuning.save_cache(out, cache)
    fresh = str(tmp_path / "fresh" / "cell")
    assert tuning.restore_cache(fresh, cache)
    assert tuning.finished_candidates(fresh) == [os.path.join(fresh, "candidates", c) for c in ("000", "001")]
    with open(os.path.join(fresh, "tuning.json")) as f:
        assert json.load(f)["split_key"] == 7  # the state the tuning resumes with, as it was
    assert not tuning.restore_cache(fresh, cache)  # never over an existing directory


def test_a_finished_tuning_is_not_cached(tmp_path):
    out, cache = str(tmp_path / "work" / "cell"), str(tmp_path / "cache" / "cell")
    _tuning(out, [0.5], running=False)
    open(os.path.join(out, "results.json"), "w").write("{}")
    assert tuning.save_cache(out, cache) == 0 and not os.path.exists(cache)
