"""``sparta_tf.make_private``: one entry point that plans, builds and runs every method (issue 43).

* every method of :data:`sparta_tf.methods.METHODS` trains through it, and the
  finished ledger records exactly the plan's events (the plan is the one the
  CLI prints; the DP step charged it from the sigma and q it ran with);
* a caller's ``PrivacyCallback`` that disagrees with the model's sigma or q is
  refused; so are a fit of another length and a second fit;
* a library user's process killed mid-``fit`` (SIGKILL) and run again with the
  same ``run_dir`` resumes from the last checkpoint, and its ledger charges at
  least every step the two processes ran (never fewer), at most one more.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf.checkpointing import CheckpointError
from sparta_tf.methods import METHODS
from sparta_tf.privacy.callbacks import PrivacyCallback
from sparta_tf.privacy.mechanism import DpSgdMechanism
from small_models import LOSS, small_data, small_mlp

N, BATCH, EPOCHS = 64, 16, 3
OPTIONS = {"sparta": {"warmup_epochs": 1}, "dpsgd_grad": {"warmup_epochs": 1}, "oracle": {"warmup_epochs": 1},
           "x_bitfit": {"full_epochs": 1}}


def _private(method: str, model=None, **kwargs):
    options = dict(OPTIONS.get(method, {}), **kwargs)
    dp = sparta_tf.make_private(model or small_mlp(), method=method, target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                batch_size=BATCH, dataset_size=N, seed=0, **options)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    return dp


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_runs_its_plan(method, tmp_path):
    model = small_mlp()
    before = [v.numpy().copy() for v in model.trainable_variables]
    dp = _private(method, model, mask_dir=str(tmp_path / "mask"))
    x, y = small_data(N)
    history = dp.fit(x, y, verbose=0)
    assert len(history.history["loss"]) == EPOCHS
    assert list(dp.ledger.entries) == dp.plan.events()
    assert dp.ledger.is_private == (method != "oracle")
    if dp.ledger.is_private:
        assert dp.ledger.epsilon() <= 8.0 * (1 + 1e-9)
    moved = [not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables)]
    assert any(moved), f"{method}: no weight trained"
    assert dp.method.name == method


def test_a_data_set_that_load_dataset_marked_marks_the_plan_and_the_ledger():
    """``normalize: standard`` without statistics computes them from the private split without noise: the CLI
    reports such a run NOT private, and so must make_private(data=...); the data set's caveats (a split key
    derived from a known seed) reach the ledger too."""
    from sparta_tf.data import load_dataset

    data = load_dataset({"source": "digits", "classes": [0, 1, 2], "normalize": "standard"}, seed=0)
    model = tf.keras.Sequential([tf.keras.Input(data.input_shape), tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)])
    dp = sparta_tf.make_private(model, method="all", target_epsilon=8.0, delta=1e-5, epochs=2, batch_size=64,
                                dataset_size=len(data.x_train), data=data)
    assert not dp.plan.private and not dp.ledger.is_private
    assert "data.normalize: standard" in dp.ledger.nonprivate_reasons[0]
    assert set(data.privacy_caveats()) <= set(dp.ledger.caveats()) and data.privacy_caveats()


def test_a_privacy_callback_with_other_values_is_refused():
    dp = _private("bitfit")
    x, y = small_data(N)
    other = PrivacyCallback(dp.ledger, DpSgdMechanism(dp.noise_multiplier * 0.5, dp.sample_rate), step_counter=dp.dp_step)
    with pytest.raises(ValueError, match="noise_multiplier .* leave it out"):
        dp.fit(x, y, verbose=0, callbacks=[other])


def test_a_plain_dp_model_refuses_a_disagreeing_privacy_callback():
    dp = sparta_tf.DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=BATCH / N, dataset_size=N, delta=1e-5, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    x, y = small_data(N)
    other = PrivacyCallback(dp.ledger, DpSgdMechanism(1.0, 0.5), step_counter=dp.dp_step)
    with pytest.raises(ValueError, match="sample_rate 0.5"):
        dp.fit(x, y, verbose=0, callbacks=[other])


def test_fit_of_another_length_and_a_second_fit_are_refused():
    dp = _private("bitfit")
    x, y = small_data(N)
    with pytest.raises(ValueError, match="the plan is for 3 epochs"):
        dp.fit(x, y, epochs=5, verbose=0)
    dp.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match="fit was called already"):
        dp.fit(x, y, verbose=0)


def test_a_noise_multiplier_over_the_target_is_refused():
    with pytest.raises(ValueError, match="noise_multiplier=0.3 spends .* more than target_epsilon=1"):
        sparta_tf.make_private(small_mlp(), method="all", target_epsilon=1.0, delta=1e-5, epochs=EPOCHS,
                               batch_size=BATCH, dataset_size=N, noise_multiplier=0.3)


def test_unknown_option_is_one_line():
    with pytest.raises(ValueError, match="has no option 'densty'"):
        sparta_tf.make_private(small_mlp(), method="sparta", target_epsilon=1.0, delta=1e-5, epochs=EPOCHS,
                               batch_size=BATCH, dataset_size=N, densty=0.2)


_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    import sparta_tf

    run_dir, kill_at, counter = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    class CountAndKill(tf.keras.callbacks.Callback):
        # Appends one line per step that ran; SIGKILLs this process after step `kill_at` (global).
        def on_train_batch_end(self, batch, logs=None):
            with open(counter, "a") as f:
                f.write("step\\n")
            if int(self.model.dp_step.numpy()) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(4, name="head")])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype(np.float32), rng.integers(0, 4, 64)
    dp = sparta_tf.make_private(model, method="sparta", target_epsilon=8.0, delta=1e-5, epochs=4, batch_size=16,
                                dataset_size=64, warmup_epochs=1, density=0.5, run_dir=run_dir)
    dp.compile(tf.keras.optimizers.SGD(0.1, momentum=0.9),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dp.fit(x, y, verbose=0, callbacks=[CountAndKill()])
    print(json.dumps({"steps": dp.ledger.steps, "epsilon": dp.ledger.epsilon(), "planned": dp.plan.steps}))
""")


def _run(script, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.parametrize("kill_at", [2, 10])  # before the first checkpoint; in the selection epoch
def test_a_killed_fit_resumes_without_under_counting(tmp_path, kill_at):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    run_dir, counter = tmp_path / "run", tmp_path / "steps.txt"
    killed = _run(script, run_dir, kill_at, counter)
    assert killed.returncode == -9, killed.stderr[-2000:]
    finished = _run(script, run_dir, -1, counter)
    assert finished.returncode == 0, finished.stderr[-2000:]
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    ran = len(counter.read_text().splitlines())  # every step either process ran
    assert ran > result["planned"] - 4, "the resumed run did not continue training"
    assert ran <= result["steps"] <= ran + 1  # no step uncharged; at most the one being journalled
    assert result["epsilon"] <= 8.0 * (1 + 1e-9)
    assert "resuming" in finished.stdout or kill_at < 4
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert sum(e["count"] for e in ledger["entries"]) == result["steps"]


def test_the_journal_covers_every_step_of_a_call_of_several(tmp_path):
    """``steps_per_execution=2``: Keras calls the step journal once before two steps, so it must journal
    (and pre-charge in ``ledger.json``) both, or a kill inside the call would charge a step fewer than ran."""
    dp = sparta_tf.make_private(small_mlp(), method="sparta", target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                batch_size=BATCH, dataset_size=N, seed=0, run_dir=str(tmp_path), **OPTIONS["sparta"])
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS, steps_per_execution=2)
    seen = []

    class ReadJournal(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            with open(tmp_path / "checkpoints" / "journal.json") as f:
                journaled = json.load(f)["started_through"]
            with open(tmp_path / "ledger.json") as f:
                charged = sum(e["count"] for e in json.load(f)["entries"])
            seen.append((int(dp.dp_step.numpy()), journaled, charged))

    dp.fit(*small_data(N), verbose=0, callbacks=[ReadJournal()])
    assert seen and all(journaled >= ran and charged >= ran for ran, journaled, charged in seen)
    assert seen[-1][0] == dp.plan.steps


def test_a_resumed_run_keeps_both_seeds_of_the_run_it_continues(tmp_path):
    """Without a given seed the run's public seed (its random mask's) is drawn apart from the secret one, and a
    run built again on the run directory continues both: the same mask, the same noise and batches."""
    def build():
        return sparta_tf.make_private(small_mlp(), method="random", target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                      batch_size=BATCH, dataset_size=N, run_dir=str(tmp_path))

    dp = build()
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    dp.fit(*small_data(N), verbose=0)
    assert dp.public_seed != dp.seed
    resumed = build()
    assert (resumed.seed, resumed.public_seed) == (dp.seed, dp.public_seed)


class _StopAfterFirstEpoch(tf.keras.callbacks.Callback):
    """Raises at the start of the second epoch, after the first epoch's checkpoint: a killed run."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("killed")


def _stopped_run(run_dir, method, model_name=None, **options):
    # seed 0: a secret seed drew DP-FROST's noisy partition choice afresh each time, and now and then it chose
    # none (a one-line ValueError, not this test's subject)
    dp = sparta_tf.make_private(small_mlp(model_name), method=method, target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                batch_size=BATCH, dataset_size=N, run_dir=str(run_dir), seed=0, **options)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    with pytest.raises(RuntimeError, match="killed"):
        dp.fit(*small_data(N), verbose=0, callbacks=[_StopAfterFirstEpoch()])
    return lambda: sparta_tf.make_private(small_mlp(model_name), method=method, target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                          batch_size=BATCH, dataset_size=N, run_dir=str(run_dir), seed=0, **options)


def test_a_resumed_run_keeps_what_its_fit_marked_before_the_checkpoints_ledger_was_restored(tmp_path):
    """A callback acting on the noiseless training loss marks the run not private when fit is called; on a
    resumed run the checkpoint's ledger is restored after that mark, and must keep it."""
    resume = _stopped_run(tmp_path, "all")
    dp = resume()
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    with pytest.warns(UserWarning):
        dp.fit(*small_data(N), verbose=0, callbacks=[tf.keras.callbacks.ReduceLROnPlateau(monitor="loss")])
    assert dp.private_run.previous is not None and dp.ledger.steps >= dp.plan.steps
    assert not dp.ledger.is_private and any("loss" in reason for reason in dp.ledger.nonprivate_reasons)


class _KillMidEpoch(tf.keras.callbacks.Callback):
    """Raises before the third step of the second epoch: a run killed with two steps after its checkpoint."""

    def on_train_batch_begin(self, batch, logs=None):
        if int(self.model.dp_step.numpy()) == N // BATCH + 2:
            raise RuntimeError("killed")


@pytest.mark.parametrize("kill", ["at the epoch's end", "mid-epoch"])
@pytest.mark.parametrize("change", ["examples reordered", "clip norm", "momentum under bands"])
def test_a_run_resumed_on_other_inputs_is_refused(tmp_path, kill, change):
    """The steps a killed run started after its checkpoint run again with the same noise and batch keys, so a
    resume on other inputs would release a noiseless difference (and another momentum would mix two banded
    factorizations in one noise buffer): refused before a step, whether or not steps were lost; the same inputs
    resume."""
    x, y = small_data(N)
    options = {"bands": 2} if change == "momentum under bands" else {}

    def run(x, y, clip_norm=1.0, momentum=0.0, callbacks=()):
        dp = sparta_tf.make_private(small_mlp("mlp"), method="all", target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                    batch_size=BATCH, dataset_size=N, run_dir=str(tmp_path), seed=0,
                                    clip_norm=clip_norm, **options)
        dp.compile(tf.keras.optimizers.SGD(0.5, momentum=momentum), loss=LOSS)
        dp.fit(x, y, verbose=0, callbacks=list(callbacks))
        return dp

    with pytest.raises(RuntimeError, match="killed"):
        run(x, y, callbacks=[_StopAfterFirstEpoch() if kill == "at the epoch's end" else _KillMidEpoch()])
    order = np.random.default_rng(0).permutation(N)
    changed = {"examples reordered": dict(x=x[order], y=y[order]), "clip norm": dict(x=x, y=y, clip_norm=0.5),
               "momentum under bands": dict(x=x, y=y, momentum=0.9)}[change]
    with pytest.raises(CheckpointError, match=r"written by a run with (other training examples|another clip norm|"
                                              r"other banded noise coefficients)[^\n]*resume with"):
        run(**changed)
    resumed = run(x, y)  # trains to the plan's end, or, charged the lost steps, while the budget lasts
    assert int(resumed.dp_step.numpy()) > N // BATCH and resumed.ledger.epsilon() <= 8.0 * (1 + 1e-9)


class _KillAtStep(tf.keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_begin(self, batch, logs=None):
        if int(self.model.dp_step.numpy()) == self.step:
            raise RuntimeError("killed")


def test_a_dp_frost_checkpoint_written_before_the_trained_digest_and_inputs_resumes(tmp_path):
    """Checkpoints of earlier versions recorded only ``mask`` (the digest of mask_selections: None for DP-FROST)
    and no inputs: they still resume."""
    resume = _stopped_run(tmp_path, "dp_frost", model_name="mlp")
    checkpoints = tmp_path / "checkpoints"
    state_file = checkpoints / (checkpoints / "latest").read_text().strip() / "state.json"
    state = json.loads(state_file.read_text())
    assert state["trained"] is not None and state["mask"] is None and "inputs" in state
    del state["trained"], state["inputs"]
    state_file.write_text(json.dumps(state))
    dp = resume()
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    dp.fit(*small_data(N), verbose=0)
    assert int(dp.dp_step.numpy()) > N // BATCH


def test_a_run_restarted_before_its_first_checkpoint_on_other_examples_is_refused(tmp_path):
    """A run killed before its first checkpoint runs DP-FROST's selection again, with a fixed seed under the same
    noise: on other examples the two selections' difference would have none, so the restart is refused; on the
    same examples it runs (and charges both selections)."""
    x, y = small_data(N)

    def run(x, y, callbacks=()):
        dp = sparta_tf.make_private(small_mlp(), method="dp_frost", target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                    batch_size=BATCH, dataset_size=N, run_dir=str(tmp_path), seed=0)
        dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
        dp.fit(x, y, verbose=0, callbacks=list(callbacks))
        return dp

    with pytest.raises(RuntimeError, match="killed"):
        run(x, y, [_KillAtStep(2)])
    order = np.random.default_rng(0).permutation(N)
    with pytest.raises(CheckpointError, match=r"before_training.json \(the mechanisms a killed run ran before "
                                              r"training\) was written by a run with other training examples"):
        run(x[order], y[order])
    restarted = run(x, y)
    assert [e.phase for e in restarted.ledger.entries].count("interrupted") >= 1


@pytest.mark.parametrize("method, options", [("dp_frost", {}), ("dp_ssgd", {"prune": "dp_snip"})])
def test_a_run_resumed_with_its_saved_choice_replaced_is_refused(tmp_path, method, options):
    """DP-FROST's partitions and DP-SNIP's kept entries are reloaded from mask_dir on resume; a file replaced
    since (another run's choice) would train coordinates the restored ledger never charged: refused before a
    step (the checkpoint records the choice's digest); the file as saved resumes."""
    from sparta_tf import masks
    from sparta_tf.checkpointing import CheckpointError

    resume = _stopped_run(tmp_path, method, model_name="mlp", **options)  # its mask reloads in this process
    saved = tmp_path / "mask" / masks.MASK_FILE
    original = saved.read_bytes()
    with np.load(saved) as arrays:
        kept = {key: arrays[key] for key in arrays.files}
    first = sorted(key for key in kept if "::" in key)[0]
    with open(saved, "wb") as f:  # another run's choice: one variable's selection fewer
        np.savez(f, **{key: value for key, value in kept.items() if key != first})
    dp = resume()
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    with pytest.raises(CheckpointError, match=r"trained with another mask[^\n]*; resume with the mask the run"):
        dp.fit(*small_data(N), verbose=0)
    saved.write_bytes(original)
    dp = resume()
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    dp.fit(*small_data(N), verbose=0)
    assert int(dp.dp_step.numpy()) == dp.plan.steps


@pytest.mark.parametrize("method, options", [("dp_frost", {}), ("dp_ssgd", {"prune": "dp_snip"})])
def test_a_run_resumed_after_a_private_choice_it_did_not_save_is_refused(tmp_path, method, options):
    """DP-FROST's selection and DP-SNIP's pruning are released once; a resumed run without the saved choice
    would draw it again with the same noise (two releases whose difference has none): refused."""
    resume = _stopped_run(tmp_path, method, **options)
    shutil.rmtree(tmp_path / "mask")
    dp = resume()
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    with pytest.raises(ValueError, match=r"is not saved|are not saved"):
        dp.fit(*small_data(N), verbose=0)
