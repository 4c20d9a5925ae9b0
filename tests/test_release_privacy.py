"""What a private tuning releases (issue 60): exactly what the repeat-and-select analysis covers.

The invariant, not the symptoms: two tunings that release the same winner's weights, values and score but
ran different numbers of candidates, with the winner at different places, write byte-identical release
directories (file bytes, names and times), for ``sparta-tune`` and for ``tune_privately``'s
``save_release``; the library returns the winner with the same names whatever ran before it. The symptoms
found were: the export's TensorFlow function ids counted the candidates' exports, ``model.keras`` was a copy
of the winner's with its times, Keras's automatic names counted the candidates built before, and
``results.json`` carried the score's noise (hence n_val) and a noiseless test accuracy. Misuse: a
``build_model`` that shares layers between candidates, and a ``run_dir``, are refused before anything trains.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf import backend
from sparta_tf.data import load_dataset
from sparta_tf.tuning import procedure
from sparta_tf.tuning.release import RELEASE_TIME, RELEASED_KEYS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINNER_SEED = 111


def tree(root: str) -> dict:
    """Relative path -> (bytes, mtime) of every file and directory under ``root``."""
    found = {}
    for directory, _, files in os.walk(root):
        found[os.path.relpath(directory, root) + "/"] = (b"", os.stat(directory).st_mtime)
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = (f.read(), os.stat(path).st_mtime)
    return found


def assert_identical(a: str, b: str) -> None:
    first, second = tree(a), tree(b)
    assert sorted(first) == sorted(second)
    different = [path for path in first if first[path] != second[path]]
    assert not different, f"differ: {different}"
    assert all(mtime == RELEASE_TIME for _, mtime in first.values())


DRIVER = textwrap.dedent('''
    """Two sparta-tune tunings releasing the same winner (run seed {winner}) after 2 and after 1 candidates."""
    import sys
    sys.path.insert(0, {tests!r})
    from sparta_tf.tuning import procedure
    from trainers import tune
    from trainers.config import validate
    from test_tuning_cli import tuning_config

    LOSER = {{"training.learning_rate": 0.03}}
    WINNER = procedure.Candidate({{"training.learning_rate": 0.1}}, {winner})
    orders = {{"two": [procedure.Candidate(LOSER, 222), WINNER], "one": [WINNER]}}
    original = procedure.Draws.draw
    for name, candidates in orders.items():
        def draw(count, space, seed=None, candidates=candidates):
            drawn = original(count, space, seed)
            return procedure.Draws(drawn.seed, drawn.seed_given, drawn.count, tuple(candidates))
        procedure.Draws.draw = staticmethod(draw)
        # the winner's score noise is 0 wherever it ran; the others' sink them
        procedure.Draws.score_noise = lambda self, index, noise: 0.0 if self.candidates[index].run_seed == {winner} \\
            else -1e6
        config = tuning_config({out!r} + "/" + name, "bitfit", epochs=2, mean=2)
        config["export"] = {{"enabled": True}}
        tune.tune(validate(config))
''')


def test_sparta_tune_releases_the_same_bytes_whatever_number_of_candidates_ran_and_wherever_the_winner_was(
        tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(winner=WINNER_SEED, tests=os.path.join(ROOT, "tests"), out=str(tmp_path)))
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=1500,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 0, result.stderr[-3000:]
    two, one = tmp_path / "two", tmp_path / "one"
    assert json.loads((two / "results.json").read_text())["not_released"]["candidates"] == 2  # the private side
    assert json.loads((one / "results.json").read_text())["not_released"]["winner"] == 0
    assert_identical(two / "release", one / "release")
    released = json.loads((two / "release" / "results.json").read_text())
    assert set(released) <= set(RELEASED_KEYS) and released["hyperparameters"] == {"training.learning_rate": 0.1}
    assert released["unit"] == "example"  # what the ledger protects
    for hidden in ("candidates", "winner", "score_noise", "validation_size", "test_accuracy", "release_dir"):
        assert hidden not in released
    assert (two / "release" / "export" / "1" / "saved_model.pb").exists()
    assert not (two / "model.keras").exists()  # nothing released beside the private state


# ----------------------------------------------------------------- the library


@pytest.fixture(scope="module")
def digits():
    return load_dataset({"source": "digits", "classes": [5, 6, 7, 8, 9], "val_fraction": 0.2, "limit_train": 300},
                        split_key=7)


def build_model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((8, 8, 1)), tf.keras.layers.Flatten(),
                                tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(5)])


def crafted(monkeypatch, candidates):
    original = procedure.Draws.draw

    def draw(count, space, seed=None):
        drawn = original(count, space, seed)
        return procedure.Draws(drawn.seed, drawn.seed_given, drawn.count, tuple(candidates))

    monkeypatch.setattr(procedure.Draws, "draw", staticmethod(draw))
    monkeypatch.setattr(procedure.Draws, "score_noise",
                        lambda self, index, noise: 0.0 if self.candidates[index].run_seed == WINNER_SEED else -1e6)


def tune(digits, **kwargs):
    arguments = dict(validation_data=(digits.x_val, digits.y_val), space={"learning_rate": [0.1, 0.5]},
                     target_epsilon=8.0, delta=1e-3, epochs=2, batch_size=64, method="bitfit", mean=2.0)
    return sparta_tf.tune_privately(build_model, digits.x_train, digits.y_train, **{**arguments, **kwargs})


def test_tune_privately_returns_and_releases_the_same_whatever_ran_before_the_winner(digits, monkeypatch, tmp_path):
    winner = procedure.Candidate({"learning_rate": 0.1}, WINNER_SEED)
    loser = {"learning_rate": 0.5}
    start = backend.name_state()
    crafted(monkeypatch, [procedure.Candidate(loser, 5), procedure.Candidate(loser, 6), winner])
    three = tune(digits)
    after_three = backend.name_state()
    backend.restore_name_state(start)  # the same process state but for the candidates that ran
    crafted(monkeypatch, [winner])
    one = tune(digits)
    assert backend.name_state() == after_three  # the next model the user builds is named alike, too
    for result in (three, one):
        assert result.hyperparameters == {"learning_rate": 0.1}
    assert three.score == one.score and three.epsilon == one.epsilon
    assert three.model.model.name == one.model.model.name
    assert [layer.name for layer in three.model.model.layers] == [layer.name for layer in one.model.model.layers]
    assert [backend.variable_key(v) for v in three.model.model.weights] == \
        [backend.variable_key(v) for v in one.model.model.weights]
    for a, b in zip(three.model.model.get_weights(), one.model.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert_identical(three.save_release(str(tmp_path / "three")), one.save_release(str(tmp_path / "one")))
    released = json.loads((tmp_path / "one" / "results.json").read_text())
    assert released["validation_score"] == one.score and released["hyperparameters"] == {"learning_rate": 0.1}


def test_a_build_model_that_shares_layers_between_candidates_is_refused_before_anything_trains(digits, monkeypatch):
    backbone = tf.keras.Sequential([tf.keras.Input((8, 8, 1)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(16)])
    trained = []
    monkeypatch.setattr(sparta_tf.DPModel, "fit", lambda self, *a, **k: trained.append(self))

    def with_shared_backbone():
        inputs = tf.keras.Input((8, 8, 1))
        return tf.keras.Model(inputs, tf.keras.layers.Dense(5)(backbone(inputs)))

    with pytest.raises(ValueError, match="sharing 2 variable"):
        sparta_tf.tune_privately(with_shared_backbone, digits.x_train, digits.y_train,
                                 validation_data=(digits.x_val, digits.y_val), space={"learning_rate": [0.1]},
                                 target_epsilon=8.0, delta=1e-3, epochs=2, batch_size=64, method="bitfit", mean=2.0)
    assert trained == []


@pytest.mark.parametrize("arguments, message", [
    ({"run_dir": "somewhere"}, "run_dir would make every candidate resume the first one's run"),
    ({"validation_data": None}, "validation_data must be"),
])
def test_a_run_dir_or_no_validation_data_is_refused_in_one_line(digits, arguments, message, tmp_path):
    if "run_dir" in arguments:
        arguments = {"run_dir": str(tmp_path / arguments["run_dir"])}
    with pytest.raises(ValueError, match=message) as error:
        tune(digits, **arguments)
    assert "\n" not in str(error.value) and not (tmp_path / "somewhere").exists()
