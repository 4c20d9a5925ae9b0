"""A library user's Keras habits under ``make_private`` (issue 53), on both Keras lines.

* the standard Keras callbacks (ModelCheckpoint full and weights-only, EarlyStopping with restore,
  TensorBoard, CSVLogger, BackupAndRestore) run through a DP ``fit``, and what they and ``dp.save``
  wrote loads in a fresh process into the model the user built, with the same predictions;
* what a DP ``fit`` cannot honour is refused in one line before anything is charged: no ``compile``,
  ``sample_weight``, ``class_weight``, ``batch_size``, a weighted dataset, a ``BackupAndRestore``
  backup of an interrupted fit, EarlyStopping's restore with averaged weights;
* ``make_private`` refuses what ``sparta-train`` refuses, for the same reason (one implementation,
  :mod:`sparta_tf.run_checks`), e.g. a batch larger than the training set, ``density=0``;
* a dataset the sampler did not make is said when ``fit`` starts; the BatchNorm refusal names the fix.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf import NotPerExampleSafeError
from sparta_tf.dp_model.fit_inputs import NotPoissonSampledWarning
from trainers import config as cli_config
from small_configs import set_key, tiny_config
from small_models import LOSS

N, BATCH, EPOCHS = 64, 16, 4


def _model() -> tf.keras.Model:
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                tf.keras.layers.Dense(4, name="head")])


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 8)).astype(np.float32), rng.integers(0, 4, N)


def _private(model=None, compile=True, **kwargs):
    options = dict(method="sparta", target_epsilon=8.0, delta=1e-5, epochs=EPOCHS, batch_size=BATCH, dataset_size=N,
                   seed=0)
    options.update(kwargs)
    if options["method"] == "sparta":
        options.setdefault("warmup_epochs", 1)
    dp = sparta_tf.make_private(model or _model(), **options)
    if compile:
        dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS, metrics=["accuracy"])
    return dp


def _assert_nothing_charged(dp):
    assert dp.ledger.steps == 0 and int(dp.dp_step.numpy()) == 0


# ---------------------------------------------------------------- callbacks and saving

_LOAD = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf

    folder, weights_file = sys.argv[1], sys.argv[2]
    x = np.load(os.path.join(folder, "x.npy"))
    def own_model():  # the user's own architecture, built again
        return tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                    tf.keras.layers.Dense(4, name="head")])
    saved = tf.keras.models.load_model(os.path.join(folder, "dp.keras"))
    checkpoint = tf.keras.models.load_model(os.path.join(folder, "checkpoint.keras"))
    best = own_model()
    best.load_weights(os.path.join(folder, weights_file))
    print(json.dumps({name: m.predict(x, verbose=0).tolist()
                      for name, m in [("saved", saved), ("checkpoint", checkpoint), ("best", best)]}))
""")


def test_keras_callbacks_run_under_dp_fit_and_what_they_save_loads_in_a_fresh_process(tmp_path):
    model = _model()
    dp = _private(model)
    x, y = _data()
    weights_file = "best.weights.h5"  # Keras 3 requires the suffix; Keras 2 writes HDF5 for it
    final_checkpoint_weights = []

    class KeepCheckpointWeights(tf.keras.callbacks.Callback):  # what the last ModelCheckpoint saw
        def on_epoch_end(self, epoch, logs=None):
            final_checkpoint_weights[:] = [w.copy() for w in model.get_weights()]

    callbacks = [
        tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "checkpoint.keras")),
        tf.keras.callbacks.ModelCheckpoint(str(tmp_path / weights_file), save_weights_only=True, monitor="val_loss",
                                           save_best_only=True),
        KeepCheckpointWeights(),
        tf.keras.callbacks.EarlyStopping(monitor="val_loss", patience=10, restore_best_weights=True),
        tf.keras.callbacks.TensorBoard(str(tmp_path / "tensorboard")),
        tf.keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        tf.keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
    ]
    history = dp.fit(x, y, validation_data=_held_out(), callbacks=callbacks, verbose=0)
    assert len(history.history["loss"]) == EPOCHS
    assert dp.ledger.steps == dp.plan.steps and dp.ledger.epsilon() <= 8.0 * (1 + 1e-9)
    assert len(open(tmp_path / "log.csv").read().strip().splitlines()) == 1 + EPOCHS
    assert any(files for _, _, files in os.walk(tmp_path / "tensorboard"))
    assert not any(files for _, _, files in os.walk(tmp_path / "backup"))  # a finished fit deletes its backup
    assert int(dp.dp_step.numpy()) == dp.plan.steps  # EarlyStopping's restore rewinds weights, not the DP step

    dp.save(str(tmp_path / "dp.keras"))
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "load.py").write_text(_LOAD)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(tmp_path), weights_file],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = {name: np.array(p) for name, p in json.loads(result.stdout.strip().splitlines()[-1]).items()}
    np.testing.assert_allclose(loaded["saved"], model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    final = _model()
    final.set_weights(final_checkpoint_weights)
    np.testing.assert_allclose(loaded["checkpoint"], final.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    assert loaded["best"].shape == (N, 4) and np.all(np.isfinite(loaded["best"]))


def test_dp_model_weights_are_the_wrapped_models():
    model = _model()
    dp = _private(model)
    assert len(dp.get_weights()) == len(model.get_weights())
    zeros = [np.zeros_like(w) for w in model.get_weights()]
    dp.set_weights(zeros)
    assert all(not w.any() for w in model.get_weights())


def test_a_backup_of_an_interrupted_fit_is_refused_before_anything_is_charged(tmp_path):
    x, y = _data()
    backup = str(tmp_path / "backup")

    class Interrupt(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        _private().fit(x, y, callbacks=[tf.keras.callbacks.BackupAndRestore(backup), Interrupt()], verbose=0)
    dp = _private()
    with pytest.raises(ValueError, match="holds the backup of an interrupted fit.*make_private\\(run_dir="):
        dp.fit(x, y, callbacks=[tf.keras.callbacks.BackupAndRestore(backup)], verbose=0)
    _assert_nothing_charged(dp)


def test_early_stopping_restore_with_averaged_weights_is_refused():
    dp = _private(ema=0.9)
    x, y = _data()
    with pytest.raises(ValueError, match="use_ema_weights=False or restore_best_weights=False"):
        dp.fit(x, y, callbacks=[tf.keras.callbacks.EarlyStopping(restore_best_weights=True)], verbose=0)
    _assert_nothing_charged(dp)


@pytest.mark.parametrize("callback", [tf.keras.callbacks.EarlyStopping(monitor="loss"),
                                      tf.keras.callbacks.ReduceLROnPlateau(monitor="accuracy")])
def test_a_callback_acting_on_a_training_metric_marks_the_run_not_private(callback, tmp_path):
    """A training metric is a noiseless mean over the sampled examples: stopping or changing the rate on it is a
    release the ledger cannot cover. A validation metric (Keras' default) is not flagged."""
    x, y = _data()
    dp = _private()
    with pytest.warns(UserWarning, match=f"{type(callback).__name__}.*acts on the training metric"):
        dp.fit(x, y, callbacks=[callback], verbose=0)
    assert not dp.ledger.is_private and "noiseless statistic" in dp.ledger.nonprivate_reasons[0]
    watched = _private()
    watched.fit(x, y, validation_data=_held_out(), verbose=0, callbacks=[
        tf.keras.callbacks.EarlyStopping(), tf.keras.callbacks.ModelCheckpoint(
            str(tmp_path / "m-{epoch}-{val_loss:.3f}.weights.h5"), save_weights_only=True)])
    assert watched.ledger.is_private


def _held_out():
    rng = np.random.default_rng(1)
    return rng.normal(size=(16, 8)).astype(np.float32), rng.integers(0, 4, 16)


class StopOnLoss(tf.keras.callbacks.Callback):
    """A user's own callback that acts on the training loss."""

    def on_epoch_end(self, epoch, logs=None):
        if dict(logs)["loss"] < 1e9:
            self.model.stop_training = True


class LogsAMetric(tf.keras.callbacks.Callback):
    """A user's own callback that reads only what is not private, and adds a metric of its own."""

    def on_epoch_end(self, epoch, logs=None):
        logs["epsilon_doubled"] = 2 * logs["epsilon"] + (logs.get("val_loss") or 0) * 0


@pytest.mark.parametrize("make", [StopOnLoss, lambda: tf.keras.callbacks.LambdaCallback(
    on_train_batch_end=lambda batch, logs: print(json.dumps(logs)))], ids=["own", "lambda"])
def test_a_users_callback_that_reads_a_training_metric_marks_the_run_not_private(make):
    """Any callback Keras does not define sees the noiseless training metrics: a read of one marks the run (it
    may decide anything from it), unless the callback is declared logging-only, which is a caveat. Reading
    epsilon and validation metrics, and writing metrics, are fine; the callback is unchanged after fit."""
    x, y = _data()
    callback = make()
    hooks = lambda: (type(callback), {k: v for k, v in vars(callback).items() if k.startswith("on_")})  # noqa: E731
    before = hooks()
    dp = _private(method="all")
    with pytest.warns(UserWarning, match=f"callback {type(callback).__name__} read the training metric"):
        dp.fit(x, y, callbacks=[callback], verbose=0)
    assert not dp.ledger.is_private and dp.ledger.epsilon() == float("inf")
    assert hooks() == before
    declared = _private(method="all")
    declared.fit(x, y, callbacks=[sparta_tf.logging_only(make())], verbose=0)
    assert declared.ledger.is_private and any("declared logging-only" in c for c in declared.ledger.caveats())
    reader = _private(method="all")
    history = reader.fit(x, y, validation_data=_held_out(), callbacks=[LogsAMetric()], verbose=0)
    assert reader.ledger.is_private and not reader.ledger.caveats()
    assert history.history["epsilon_doubled"] == [2 * e for e in history.history["epsilon"]]


def test_validation_data_that_holds_training_examples_makes_its_metrics_private(tmp_path):
    """val_loss on training examples is a noiseless statistic of them: acting on it (EarlyStopping, a best-only
    checkpoint, a file name) marks the run, as a user's callback reading it does; one shared example suffices."""
    x, y = _data()
    x_val, y_val = _held_out()
    x_val[3] = x[10]
    for callback in (tf.keras.callbacks.EarlyStopping(restore_best_weights=True),
                     tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "{val_loss:.4f}.weights.h5"),
                                                        save_weights_only=True)):
        dp = _private(method="all")
        with pytest.warns(UserWarning, match="validation data that holds training examples"):
            dp.fit(x, y, validation_data=(x_val.astype(np.float64), y_val), callbacks=[callback], verbose=0)
        assert not dp.ledger.is_private
    dp = _private(method="all")
    with pytest.warns(UserWarning, match="callback LogsAMetric read the validation metric 'val_loss'"):
        dp.fit(x, y, validation_data=(x_val, y_val), callbacks=[LogsAMetric()], verbose=0)
    dataset = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(8)
    unchecked = _private(method="all")
    unchecked.fit(x, y, validation_data=dataset, callbacks=[tf.keras.callbacks.EarlyStopping()], verbose=0)
    assert unchecked.ledger.is_private and any("not checked for training examples" in c
                                               for c in unchecked.ledger.caveats())


def test_a_checkpoint_named_by_a_training_metric_marks_the_run_not_private(tmp_path):
    x, y = _data()
    dp = _private(method="all")
    with pytest.warns(UserWarning, match="ModelCheckpoint's file names format the training metric 'loss'"):
        dp.fit(x, y, verbose=0, callbacks=[tf.keras.callbacks.ModelCheckpoint(
            str(tmp_path / "w-{epoch:02d}-{loss:.5f}.weights.h5"), save_weights_only=True)])
    assert not dp.ledger.is_private


@pytest.mark.parametrize("metrics", [[tf.keras.metrics.SparseCategoricalAccuracy(name="val_acc")], ["accuracy"]])
def test_a_metric_named_like_a_validation_metric_is_refused(metrics):
    """Its training values would be logged as val_acc, which the callback checks take for validation."""
    dp = _private(compile=False)
    if metrics == ["accuracy"]:
        dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS, metrics=metrics)
        return
    with pytest.raises(ValueError, match="'val_acc' starts with 'val_'.*rename it"):
        dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS, metrics=metrics)


def test_terminate_on_nan_marks_the_run_not_private():
    """It stops on the logged loss, which one example the DP step dropped can make NaN."""
    x, y = _data()
    dp = _private()
    with pytest.warns(UserWarning, match="TerminateOnNaN stops on the training loss"):
        dp.fit(x, y, callbacks=[tf.keras.callbacks.TerminateOnNaN()], verbose=0)
    assert not dp.ledger.is_private and "NonFiniteGuard" in dp.ledger.nonprivate_reasons[0]


def test_train_on_batch_marks_the_run_not_private():
    """A batch the user picks is no Poisson sample and its step is outside fit's ledger: it used to leave
    epsilon at 0 with no reason recorded."""
    x, y = _data()
    dp = _private()
    with pytest.warns(UserWarning, match="train_on_batch ran a DP step on a batch chosen outside fit"):
        dp.train_on_batch(x[:8], y[:8])
    assert not dp.ledger.is_private and dp.ledger.epsilon() == float("inf")


class ListModel(tf.keras.Model):
    """A subclassed model whose ``__init__`` takes layers: Keras has no config for it."""

    def __init__(self, layers):
        super().__init__()
        self.stack = layers

    def call(self, x):
        for layer in self.stack:
            x = layer(x)
        return x


def test_a_whole_model_checkpoint_of_a_model_keras_cannot_save_is_refused_before_anything_is_charged(tmp_path):
    model = ListModel([tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(4)])
    model(np.zeros((1, 8), np.float32))
    dp = _private(model, method="all")
    x, y = _data()
    if not _raises_not_implemented(model.get_config):
        pytest.skip("Keras 2 saves a model without get_config (with a warning): nothing to refuse")
    with pytest.raises(ValueError, match="saves the whole model, but ListModel has no get_config.*"
                                         "save_weights_only=True"):
        dp.fit(x, y, callbacks=[tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"))], verbose=0)
    _assert_nothing_charged(dp)
    dp.fit(x, y, callbacks=[tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"),
                                                                save_weights_only=True)], verbose=0)
    assert (tmp_path / "m.weights.h5").exists()


def _raises_not_implemented(call) -> bool:
    try:
        call()
    except NotImplementedError:
        return True
    return False


# ---------------------------------------------------------------- refused before anything is charged

def _weighted_dataset(weight: float) -> tf.data.Dataset:
    x, y = _data()
    return tf.data.Dataset.from_tensor_slices((x, y, np.full(N, weight, np.float32))).batch(BATCH)


@pytest.mark.parametrize("call, message", [
    (lambda dp, x, y: dp.fit(x, y, sample_weight=np.ones(N), verbose=0), r"fit\(sample_weight=...\) is not supported"),
    (lambda dp, x, y: dp.fit(x, y, class_weight={0: 2.0}, verbose=0), r"fit\(class_weight=...\) is not supported"),
    (lambda dp, x, y: dp.fit(x, y, batch_size=64, verbose=0), r"fit\(batch_size=64\): the batches are Poisson samples "
                                                                r"of expected size q n = 16"),
    (lambda dp, x, y: dp.fit(_weighted_dataset(2.0), verbose=0), "the dataset's sample weights include 2: .*0/1 "
                                                                   "padding mask"),
], ids=["sample_weight", "class_weight", "batch_size", "weighted_dataset"])
def test_what_fit_cannot_honour_is_one_line_before_anything_is_charged(call, message):
    dp = _private(method="dp_frost")  # charges its partition selection when fit starts
    x, y = _data()
    with pytest.raises(ValueError, match=message) as error:
        call(dp, x, y)
    assert "\n" not in str(error.value)
    _assert_nothing_charged(dp)


def test_fit_before_compile_is_one_line():
    dp = _private(compile=False)
    x, y = _data()
    with pytest.raises(ValueError, match=r"compile the model returned by make_private \(optimizer and loss\) before"):
        dp.fit(x, y, verbose=0)
    plain = sparta_tf.DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25)
    with pytest.raises(ValueError, match="compile the DPModel"):
        plain.fit(x, y, verbose=0)


def test_a_dataset_the_sampler_did_not_make_is_said_when_fit_starts():
    dp = _private(method="bitfit")
    with pytest.warns(NotPoissonSampledWarning, match="PoissonSampler did not make"):
        dp.fit(_weighted_dataset(1.0), verbose=0)


def test_batchnorm_refusal_counts_the_layers_and_names_the_helper():
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(8), tf.keras.layers.BatchNormalization(),
                                 tf.keras.layers.Dense(8), tf.keras.layers.BatchNormalization(),
                                 tf.keras.layers.Dense(4)])
    with pytest.raises(NotPerExampleSafeError, match=r"2 layers .*replace_batchnorm\(model, \"groupnorm\"\).*"
                                                     r"replace_batchnorm\(model, \"freeze\"\)"):
        _private(model)
    _private(sparta_tf.models.replace_batchnorm(model, "freeze"))  # the named fix works


# ---------------------------------------------------------------- make_private refuses what sparta-train refuses

# (make_private keyword arguments, config overrides, training-set size n, the shared reason)
SHARED_REFUSALS = [
    ({"batch_size": 500}, {"training.batch_size": 500}, 200, "is larger than the training set (n=200); use <= 200"),
    ({"epochs": 0}, {"training.epochs": 0}, N, "must be >= 1"),
    ({"noise_multiplier": 0}, {"privacy.noise_multiplier": 0}, N, "gives no privacy"),
    ({"engine": "foo"}, {"training.engine": "foo"}, N, "must be one of auto, bookkeeping, layerwise, vectorized"),
    ({"density": 0}, {"method.density": 0}, N, "keeps no kernel row or entry: method sparta would train only"),
    ({"warmup_epochs": 3}, {"method.warmup_epochs": 3}, N, "must leave a sparse epoch"),
    ({"delta": 0.01}, {"privacy.delta": 0.01}, 200, "must be < 1/n = 0.005 for n=200 training examples"),
    ({"physical_batch_size": 0}, {"training.physical_batch_size": 0}, N, "must be >= 1"),
    ({"jit_compile": "yes"}, {"training.jit_compile": "yes"}, N, "must be true, false or auto"),
]


@pytest.mark.parametrize("library, config, n, reason", SHARED_REFUSALS,
                         ids=[next(iter(case[0])) for case in SHARED_REFUSALS])
def test_make_private_refuses_what_the_config_refuses_with_the_same_reason(library, config, n, reason, tmp_path):
    with pytest.raises(ValueError) as from_library:
        _private(compile=False, dataset_size=n, **library)
    raw = tiny_config(str(tmp_path), method="sparta", epochs=EPOCHS)
    raw["method"]["warmup_epochs"] = 1
    for key, value in config.items():
        set_key(raw, key, value)
    with pytest.raises(cli_config.ConfigError) as from_config:
        cli_config.check_against_data(cli_config.validate(raw), n)
    library_line, config_line = str(from_library.value), str(from_config.value)
    assert reason in library_line and reason in config_line
    # the same sentence, each setting named as its side spells it (config section.key, library keyword)
    assert re.sub(r"\b(training|privacy|method)\.", "", config_line.replace("method.name=", "method=")) == library_line


def test_a_fractional_dataset_size_is_refused():
    with pytest.raises(ValueError, match=r"dataset_size=100.5 must be a whole number >= 1"):
        _private(compile=False, dataset_size=100.5)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_fit_stopped_by_an_exception_charges_every_step_it_ran(stop):
    """Ctrl-C in a notebook, or a callback that raises: Keras skips ``on_train_end``, so the steps of the
    interrupted epoch must be charged on the way out, or the ledger would release a trained model at
    epsilon 0."""
    dp = sparta_tf.DPModel(_model(), noise_multiplier=1.0, sample_rate=BATCH / N, delta=1e-5, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)

    class Stop(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise stop("stopped")

    with pytest.raises(stop):
        dp.fit(*_data(), epochs=2, verbose=0, callbacks=[Stop()])
    assert int(dp.dp_step.numpy()) == 3 and dp.ledger.steps == 3 and dp.ledger.epsilon() > 0
    dp.fit(*_data(), epochs=1, verbose=0)  # a later fit charges its own steps, none twice
    assert dp.ledger.steps == int(dp.dp_step.numpy())


def test_a_steps_per_execution_that_does_not_divide_the_epoch_runs_the_plan_or_is_refused():
    """Keras 3 runs every call of N steps whole, so with N not dividing the epoch's 4 steps an epoch would run 6
    and the phases drift off the plan: refused before a step. Keras 2 shortens the last call: the plan runs."""
    from sparta_tf.backend import KERAS3

    dp = _private(compile=False)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS, steps_per_execution=3)
    if KERAS3:
        with pytest.raises(ValueError, match=r"^steps_per_execution=3 does not divide an epoch's 4 DP steps"):
            dp.fit(*_data(), verbose=0)
        _assert_nothing_charged(dp)
    else:
        dp.fit(*_data(), verbose=0)
        assert int(dp.dp_step.numpy()) == dp.ledger.steps == dp.plan.steps
