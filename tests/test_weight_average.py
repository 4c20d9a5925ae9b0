"""Weight averaging (``ema``, :mod:`sparta_tf.optim.weight_average`; issue 50 point 2).

* the averages follow ``A <- A + (1 - b_t)(W - A)``, ``b_t = min(decay, (1 + t)/(10 + t))``, after every
  DP-SGD update, against a NumPy reference (XLA on and off, one and two replicas);
* frozen coordinates (outside the trainable set, e.g. SPARTA's unselected rows) are bit-identical in the
  averaged model; a selection epoch does not average;
* ``ema=None`` is today's model, and with ``ema`` the raw weights and the ledger are those of a run without;
* validation swaps the averages in and the raw weights back exactly; the model holds the averages after
  ``fit`` (``use_ema_weights``); a resumed run restores the averages and the counter and ends identically;
* the CLI's ``training.ema`` is validated, and ``results.json`` reports both test accuracies.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from small_configs import tiny_config
from small_models import LOSS, small_data, small_mlp
from sparta_tf import DPModel, trainable
from sparta_tf.groups import row_groups
from sparta_tf.methods import METHODS
from sparta_tf.optim.masked_optimizer import MaskedOptimizer
from sparta_tf.trainable import TrainableSet
from trainers.config import ConfigError, validate
from two_replicas import two_cpu_replicas

N, BATCH, EPOCHS = 64, 16, 3


class RecordWeights(tf.keras.callbacks.Callback):
    """The wrapped model's trainable weights when training begins and after every training step."""

    def __init__(self, variables):
        super().__init__()
        self.variables, self.steps = variables, []

    def on_train_begin(self, logs=None):
        self.start = [v.numpy().copy() for v in self.variables]

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([v.numpy().copy() for v in self.variables])


def reference_average(start, steps, decay):
    """NumPy (float32): ``A_0 = W_0``, ``A <- A + (1 - b_t)(W_{t+1} - A)``, ``b_t = min(decay, (1+t)/(10+t))``."""
    average = [w.copy() for w in start]
    for t, weights in enumerate(steps):
        b = min(np.float32(decay), np.float32(1 + t) / np.float32(10 + t))
        rate = np.float32(1) - np.float32(b)
        average = [a + rate * (w - a) for a, w in zip(average, weights)]
    return average


def dp_model(ema=0.5, jit_compile=False, **kwargs):
    dp = DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=BATCH / N, dataset_size=N, seed=0, ema=ema,
                 jit_compile=jit_compile, **kwargs)
    dp.compile(tf.keras.optimizers.SGD(0.2, momentum=0.5), loss=LOSS, metrics=["accuracy"])
    return dp


def private(ema=0.9, method="sparta", **kwargs):
    dp = sparta_tf.make_private(small_mlp(), method=method, target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                batch_size=BATCH, dataset_size=N, seed=0, ema=ema, warmup_epochs=1, **kwargs)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    return dp


def values(variables):
    return [v.numpy().copy() for v in variables]


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager-graph", "xla"])
def test_the_average_follows_the_numpy_reference_with_warm_up(jit_compile):
    dp = dp_model(ema=0.5, jit_compile=jit_compile)  # b_t = (1+t)/(10+t) for t < 8, then 0.5
    record = RecordWeights(dp.model.trainable_variables)
    x, y = small_data(N)
    dp.fit(x, y, epochs=3, verbose=0, callbacks=[record])
    assert len(record.steps) == 12 and int(dp.weight_average.updates.numpy()) == 12
    expected = reference_average(record.start, record.steps, 0.5)
    for average, reference in zip(values(dp.weight_average.averages), expected):
        np.testing.assert_allclose(average, reference, rtol=2e-6, atol=1e-7)
    assert dp.weight_average.holds_averages  # use_ema_weights=True: the model holds the averages after fit
    for weight, average in zip(values(dp.model.trainable_variables), values(dp.weight_average.averages)):
        np.testing.assert_array_equal(weight, average)
    dp.weight_average.use_raw()
    for weight, raw in zip(values(dp.model.trainable_variables), record.steps[-1]):
        np.testing.assert_array_equal(weight, raw)


def test_two_replicas_average_as_one():
    two_replicas = two_cpu_replicas()
    x, y = small_data(N)
    averages = []
    for strategy in (tf.distribute.get_strategy(), two_replicas):
        with strategy.scope():
            dp = dp_model(ema=0.5, physical_batch_size=32)
        dp.fit(x, y, epochs=2, verbose=0)
        averages.append(values(dp.weight_average.averages))
        assert int(dp.weight_average.updates.numpy()) == 8
    for one, two in zip(*averages):
        np.testing.assert_allclose(one, two, rtol=1e-5, atol=1e-6)


def test_frozen_rows_are_bit_identical_in_the_average():
    dp = dp_model(ema=0.5)
    model = dp.model
    group = next(g for g in row_groups(model, model.get_layer("head")) if g.variable is model.get_layer("d1").kernel)
    selections = [trainable.rows(group, [1, 5, 30]), trainable.dense(model.get_layer("head").kernel)]
    dp.set_trainable_set(TrainableSet(selections))
    before = values(model.trainable_variables)
    x, y = small_data(N)
    dp.fit(x, y, epochs=2, verbose=0)
    trained = {id(s.variable): s.dense_mask() for s in selections}
    for variable, old, average in zip(model.trainable_variables, before, values(dp.weight_average.averages)):
        mask = trained.get(id(variable), np.zeros(old.shape, bool))
        np.testing.assert_array_equal(average[~mask], old[~mask], err_msg=f"frozen part of {variable.name}")
        assert np.all(average[mask] != old[mask]), f"the average of {variable.name} did not move"


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_averages_its_updates(method, tmp_path):
    options = {"warmup_epochs": 1} if method in ("sparta", "dpsgd_grad", "oracle") else (
        {"full_epochs": 1} if method == "x_bitfit" else {})
    dp = sparta_tf.make_private(small_mlp(), method=method, target_epsilon=8.0, delta=1e-5, epochs=EPOCHS,
                                batch_size=BATCH, dataset_size=N, seed=0, ema=0.9, mask_dir=str(tmp_path / "mask"),
                                **options)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    x, y = small_data(N)
    dp.fit(x, y, verbose=0)
    assert int(dp.weight_average.updates.numpy()) == int(dp.optimizer.iterations.numpy()) == dp.plan.update_steps
    assert dp.weight_average.holds_averages
    assert list(dp.ledger.entries) == dp.plan.events()


def test_sparta_averages_only_its_updates_and_keeps_unselected_rows_bit_identical():
    model_before = values(small_mlp().trainable_variables)  # small_mlp is seeded: the same initial weights
    dp = private(ema=0.9)
    x, y = small_data(N)
    dp.fit(x, y, verbose=0)
    # the selection epoch releases scores, moves no weight and does not average
    assert int(dp.weight_average.updates.numpy()) == int(dp.optimizer.iterations.numpy()) == dp.plan.update_steps
    sparse = {id(s.variable): s.dense_mask() for s in dp.trainable_set}  # warm-up set (biases, head) is inside it
    frozen_seen = 0
    for variable, old in zip(dp.model.trainable_variables, model_before):
        mask = sparse.get(id(variable), np.zeros(old.shape, bool))
        held = variable.numpy()  # the averaged model (use_ema_weights)
        np.testing.assert_array_equal(held[~mask], old[~mask], err_msg=f"frozen part of {variable.name}")
        frozen_seen += int((~mask).sum())
    assert frozen_seen > 0


def test_without_ema_nothing_changes_and_with_it_training_and_the_ledger_are_the_same():
    x, y = small_data(N)
    plain, averaged = private(ema=None), private(ema=0.9, use_ema_weights=False)
    assert plain.weight_average is None and "weight_average" not in plain.checkpoint_state()
    assert plain._gradient_release().average is None
    for dp in (plain, averaged):
        dp.fit(x, y, verbose=0)
    assert not averaged.weight_average.holds_averages  # use_ema_weights=False: the raw weights stay in
    for a, b in zip(values(plain.model.trainable_variables), values(averaged.model.trainable_variables)):
        np.testing.assert_array_equal(a, b)  # averaging reads the weights, never moves them
    assert list(plain.ledger.entries) == list(averaged.ledger.entries) == plain.plan.events()
    assert plain.ledger.epsilon() == averaged.ledger.epsilon()


def test_validation_evaluates_the_averages_and_puts_the_raw_weights_back_exactly():
    x, y = small_data(N)

    class Probe(tf.keras.callbacks.Callback):
        def __init__(self, dp):
            super().__init__()
            self.dp, self.in_validation, self.after_epoch = dp, [], []

        def on_test_batch_end(self, batch, logs=None):
            self.in_validation.append(all(np.array_equal(w, a) for w, a in zip(
                values(self.dp.model.trainable_variables), values(self.dp.weight_average.averages))))

        def on_epoch_end(self, epoch, logs=None):
            self.after_epoch.append(values(self.dp.model.trainable_variables))

    with_validation, without = dp_model(), dp_model()
    probe, record = Probe(with_validation), RecordWeights(without.model.trainable_variables)
    history = with_validation.fit(x, y, epochs=2, verbose=0, validation_data=(x[:20], y[:20]), callbacks=[probe])
    without.fit(x, y, epochs=2, verbose=0, callbacks=[record])
    assert probe.in_validation and all(probe.in_validation)
    np.testing.assert_array_equal(probe.after_epoch[-1][0], record.steps[-1][0])  # raw weights back after validation
    with_validation.weight_average.use_raw()
    without.weight_average.use_raw()
    for a, b in zip(values(with_validation.model.trainable_variables), values(without.model.trainable_variables)):
        np.testing.assert_array_equal(a, b)
    with_validation.weight_average.use_averages()
    assert history.history["val_loss"][-1] == pytest.approx(with_validation.evaluate(x[:20], y[:20], verbose=0)[0],
                                                            rel=1e-6)


def test_a_resumed_run_restores_the_averages_and_ends_as_an_uninterrupted_one(tmp_path):
    x, y = small_data(N)

    class StopAtSecondEpoch(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt("stopped after the first epoch's checkpoint")

    whole = private(run_dir=str(tmp_path / "whole"))
    whole.fit(x, y, verbose=0)
    first = private(run_dir=str(tmp_path / "resumed"))
    with pytest.raises(KeyboardInterrupt):
        first.fit(x, y, verbose=0, callbacks=[StopAtSecondEpoch()])
    saved_updates = int(first.weight_average.updates.numpy())
    resumed = private(run_dir=str(tmp_path / "resumed"))
    resumed.fit(x, y, verbose=0)
    assert saved_updates > 0
    assert int(resumed.weight_average.updates.numpy()) == int(whole.weight_average.updates.numpy())
    for a, b in zip(values(resumed.weight_average.averages), values(whole.weight_average.averages)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(values(resumed.model.trainable_variables), values(whole.model.trainable_variables)):
        np.testing.assert_array_equal(a, b)


def test_bad_decays_and_keras_ema_are_refused_with_the_fix():
    for bad in (0, 1, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"ema=.* must be a decay in \(0, 1\)"):
            dp_model(ema=bad)
    with pytest.raises(ValueError, match=r"use_ema=True.*ema=0\.999.*training\.ema"):
        MaskedOptimizer(tf.keras.optimizers.SGD(0.1, use_ema=True))


def test_the_config_validates_training_ema(tmp_path):
    config = validate(tiny_config(tmp_path))
    assert config["training"]["ema"] is None and config["training"]["use_ema_weights"] is True
    assert validate(tiny_config(tmp_path, ema=0.999))["training"]["ema"] == 0.999
    for bad, problem in ((1.5, r"must be a decay in \(0, 1\)"), (0, r"must be a decay in \(0, 1\)"),
                         ("high", "must be")):
        with pytest.raises(ConfigError, match=rf"^training\.ema={bad!r} {problem}"):
            validate(tiny_config(tmp_path, ema=bad))


def test_results_report_the_raw_and_the_averaged_test_accuracy(tmp_path):
    from trainers import run

    results = run.train(validate(tiny_config(tmp_path / "run", "bitfit", epochs=2, ema=0.9)))
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert on_disk["test_weights"] == "ema"
    assert on_disk["test_accuracy"] == on_disk["test_accuracy_ema_weights"] == results["test_accuracy"]
    assert 0 <= on_disk["test_accuracy_raw_weights"] <= 1
