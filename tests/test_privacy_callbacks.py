"""Tests for sparta_tf.privacy.callbacks.PrivacyCallback on a tiny Keras model."""

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.privacy import accounting
from sparta_tf.privacy.accounting import PrivacyBudgetExceededError
from sparta_tf.privacy.callbacks import PrivacyCallback
from sparta_tf.privacy.ledger import LedgerEntry, PrivacyLedger
from sparta_tf.privacy.mechanism import DpSgdMechanism

DELTA = 1e-5
N, BATCH = 32, 8
Q = BATCH / N  # 0.25
STEPS_PER_EPOCH = N // BATCH  # 4
SIGMA = 1.0
MECHANISM = DpSgdMechanism(SIGMA, Q)

# Keras's own fit() calls random.randint with a float bound; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:non-integer arguments to randrange")


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 3)).astype("float32"), rng.normal(size=(N, 1)).astype("float32")


def _model(steps_per_execution=1):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(
        optimizer=tf.keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=steps_per_execution
    )
    return model


def _fit(model, callbacks, epochs):
    x, y = _data()
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


def _epsilon(steps, sigma=SIGMA):
    return accounting.compute_epsilon(sigma, Q, steps, DELTA)


@pytest.mark.parametrize("use_counter", [True, False])
def test_records_steps_and_logs_epsilon_into_history(use_counter):
    model = _model()
    ledger = PrivacyLedger(DELTA)
    counter = model.optimizer.iterations if use_counter else None
    callback = PrivacyCallback(ledger, MECHANISM, phase="warmup", step_counter=counter)
    history = _fit(model, [callback], epochs=2)
    assert ledger.entries == (LedgerEntry(SIGMA, Q, 2 * STEPS_PER_EPOCH, "dp_sgd_step", "warmup"),)
    assert history.history["epsilon"] == [_epsilon(4), _epsilon(8)]
    assert history.history["epsilon"][-1] == ledger.epsilon()


def test_counts_batches_across_fits_with_steps_per_execution():
    model = _model(steps_per_execution=2)
    ledger = PrivacyLedger(DELTA)
    callback = PrivacyCallback(ledger, MECHANISM)  # no counter: count batches
    _fit(model, [callback], epochs=1)
    _fit(model, [callback], epochs=1)  # e.g. the next phase of a run
    assert ledger.entries == (LedgerEntry(SIGMA, Q, 8, "dp_sgd_step", None),)
    assert int(model.optimizer.iterations.numpy()) == 8


def test_records_the_values_in_force_when_they_change_between_epochs():
    model = _model()
    ledger = PrivacyLedger(DELTA)
    callback = PrivacyCallback(ledger, MECHANISM, step_counter=model.optimizer.iterations)

    def switch(epoch, logs):
        callback.noise_multiplier, callback.phase = 2.0, "sparse"

    _fit(model, [tf.keras.callbacks.LambdaCallback(on_epoch_end=switch), callback], epochs=2)
    assert ledger.entries == (
        LedgerEntry(SIGMA, Q, 4, "dp_sgd_step", None),
        LedgerEntry(2.0, Q, 4, "dp_sgd_step", "sparse"),
    )


def test_refuses_to_start_an_over_budget_run():
    model = _model()
    kernel = model.get_weights()[0].copy()
    ledger = PrivacyLedger(DELTA, target_epsilon=_epsilon(8) * 0.999)  # 2 epochs do not fit
    saves = []
    callback = PrivacyCallback(
        ledger, MECHANISM, step_counter=model.optimizer.iterations, on_budget_exhausted=lambda: saves.append(1)
    )
    with pytest.raises(PrivacyBudgetExceededError) as info:
        _fit(model, [callback], epochs=2)
    message = str(info.value)
    assert "\n" not in message
    assert "target_epsilon" in message and "raise noise_multiplier" in message
    assert int(model.optimizer.iterations.numpy()) == 0  # no step ran
    np.testing.assert_array_equal(model.get_weights()[0], kernel)
    assert ledger.steps == 0 and saves == []


def test_stops_when_the_budget_runs_out_and_calls_the_save_hook(capsys):
    model = _model()
    ledger = PrivacyLedger(DELTA, target_epsilon=_epsilon(8) * 1.001)  # exactly 2 epochs fit
    saved = []
    callback = PrivacyCallback(
        ledger, MECHANISM,
        step_counter=model.optimizer.iterations,
        on_budget_exhausted=lambda: saved.append(ledger.steps),
        budget_mode="until_exhausted",
    )
    history = _fit(model, [callback], epochs=5)
    assert len(history.history["epsilon"]) == 2
    assert saved == [8]  # hook called once, after the ledger was complete
    assert callback.budget_exhausted
    assert int(model.optimizer.iterations.numpy()) == 8
    assert ledger.steps == 8 and ledger.epsilon() <= ledger.target_epsilon
    assert "privacy budget exhausted" in capsys.readouterr().out


def test_until_exhausted_runs_the_steps_of_a_last_epoch_that_still_fit(capsys):
    """A budget for 10 steps of 4-step epochs: two whole epochs, then 2 steps of the third, then stop."""
    model = _model()
    ledger = PrivacyLedger(DELTA, target_epsilon=_epsilon(10) * 1.0001)
    saved = []
    callback = PrivacyCallback(ledger, MECHANISM, step_counter=model.optimizer.iterations,
                               on_budget_exhausted=lambda: saved.append(ledger.steps), budget_mode="until_exhausted")
    history = _fit(model, [callback], epochs=5)
    assert int(model.optimizer.iterations.numpy()) == ledger.steps == 10
    assert ledger.epsilon() <= ledger.target_epsilon
    assert len(history.history["epsilon"]) == 3 and callback.budget_exhausted and saved == [10]
    assert "only 2 of the 4 steps of epoch 3" in capsys.readouterr().out


def test_never_runs_a_step_past_the_budget_when_noise_is_lowered_mid_run():
    model = _model()
    ledger = PrivacyLedger(DELTA, target_epsilon=_epsilon(12) * 1.001)  # 3 epochs at SIGMA fit
    saved = []
    callback = PrivacyCallback(
        ledger, MECHANISM,
        step_counter=model.optimizer.iterations,
        on_budget_exhausted=lambda: saved.append(ledger.steps),
    )

    def lower_noise(epoch, logs):  # runs after the callback's own end-of-epoch check
        callback.noise_multiplier = 0.7

    lowering = tf.keras.callbacks.LambdaCallback(on_epoch_end=lower_noise)
    with pytest.raises(PrivacyBudgetExceededError):
        _fit(model, [callback, lowering], epochs=3)
    assert int(model.optimizer.iterations.numpy()) == 4  # nothing ran in epoch 2
    assert saved == [4]
    assert ledger.epsilon() <= ledger.target_epsilon


def test_stops_mid_epoch_when_an_epoch_has_more_steps_than_planned():
    model = _model()
    ledger = PrivacyLedger(DELTA, target_epsilon=_epsilon(3) * 1.001)
    saved = []
    callback = PrivacyCallback(
        ledger, MECHANISM,
        steps_per_epoch=2,  # wrong plan: the epoch really has 4 steps
        step_counter=model.optimizer.iterations,
        on_budget_exhausted=lambda: saved.append(ledger.steps),
        verbose=0,
    )
    with pytest.raises(PrivacyBudgetExceededError, match="one more step"):
        _fit(model, [callback], epochs=1)
    assert int(model.optimizer.iterations.numpy()) == 3  # the 4th step never ran
    assert saved == [3] and ledger.steps == 3
    assert ledger.epsilon() <= ledger.target_epsilon


def test_budget_check_without_target_is_skipped():
    model = _model()
    ledger = PrivacyLedger(DELTA)
    callback = PrivacyCallback(ledger, MECHANISM, steps_per_epoch=1)  # no target: no planning
    history = _fit(model, [callback], epochs=1)
    assert ledger.steps == STEPS_PER_EPOCH and not callback.budget_exhausted
    assert history.history["epsilon"] == [_epsilon(4)]


def test_rejects_unknown_budget_mode():
    with pytest.raises(ValueError, match="budget_mode"):
        PrivacyCallback(PrivacyLedger(DELTA), MECHANISM, budget_mode="lenient")


class _RaiseAfterTwoSteps(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise RuntimeError("interrupted")


def _dp_model():
    from sparta_tf import DPModel

    dp = DPModel(_model(), noise_multiplier=SIGMA, sample_rate=Q, delta=DELTA, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.01), loss="mse")
    return dp


def test_steps_of_a_dp_fit_that_raised_are_charged_on_its_way_out_and_never_twice():
    """Regression: every DPModel.fit made a new callback counting dp_step from its current value,
    so the steps of a fit that ended in an exception (no epoch end, no train end) were never charged;
    then they waited for the next fit. They are charged as the fit raises, and the next fit adds its own."""
    x, y = _data()
    dp = _dp_model()
    with pytest.raises(RuntimeError, match="interrupted"):
        dp.fit(x, y, epochs=2, verbose=0, callbacks=[_RaiseAfterTwoSteps()])
    assert int(dp.dp_step.numpy()) == 2 and dp.ledger.steps == 2
    dp.fit(x, y, epochs=1, verbose=0)
    assert dp.ledger.steps == int(dp.dp_step.numpy()) == 2 + STEPS_PER_EPOCH
    assert dp.ledger.epsilon() == pytest.approx(_epsilon(2 + STEPS_PER_EPOCH), rel=1e-6)



def test_a_checkpoint_restored_without_its_ledger_is_refused_and_with_it_counts_every_step(tmp_path):
    """Regression: checkpoint_state() holds dp_step but not the ledger; restored into a new DPModel,
    fit counted epsilon from the restored step, leaving the first run's steps out."""
    x, y = _data()
    first = _dp_model()
    first.fit(x, y, epochs=1, verbose=0)
    path = tf.train.Checkpoint(**first.checkpoint_state()).write(str(tmp_path / "ckpt"))
    restored = _dp_model()
    tf.train.Checkpoint(**restored.checkpoint_state()).read(path).expect_partial()
    with pytest.raises(ValueError, match="ledger records 0 DP steps"):
        restored.fit(x, y, epochs=1, verbose=0)
    restored.ledger.record(SIGMA, Q, STEPS_PER_EPOCH, phase="mask:selection")  # a loaded mask's cost: not our steps
    with pytest.raises(ValueError, match="ledger records 0 DP steps"):
        restored.fit(x, y, epochs=1, verbose=0)
    restored.ledger = PrivacyLedger.from_json(first.ledger.to_json())
    restored.fit(x, y, epochs=1, verbose=0)
    assert restored.ledger.steps == int(restored.dp_step.numpy()) == 2 * STEPS_PER_EPOCH


def test_a_delta_of_at_least_one_over_n_is_refused():
    """(eps, 1/n)-DP allows publishing one example outright; the CLI refused such a delta, the library did not."""
    from sparta_tf import DPModel

    with pytest.raises(ValueError, match=r"delta=0.2 must be < 1/n = 0.2 for n=5"):
        DPModel(_model(), noise_multiplier=SIGMA, sample_rate=Q, delta=0.2, dataset_size=5)
    x, y = _data()
    dp = DPModel(_model(), noise_multiplier=SIGMA, sample_rate=Q, delta=1.0 / len(x), seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.01), loss="mse")
    with pytest.raises(ValueError, match="must be < 1/n"):
        dp.fit(x, y, epochs=1, verbose=0)


def test_a_call_of_several_steps_is_checked_whole_against_the_budget():
    """With ``steps_per_execution=2`` a call runs two steps after one ``on_train_batch_begin`` (both Keras
    lines): when only three of an epoch's four steps fit, the second call must not start."""
    model = _model(steps_per_execution=2)
    three_steps = accounting.compute_epsilon(SIGMA, Q, 3, DELTA)
    ledger = PrivacyLedger(DELTA, target_epsilon=three_steps * (1 + 1e-6))
    callback = PrivacyCallback(ledger, MECHANISM, step_counter=model.optimizer.iterations,
                               budget_mode="until_exhausted", verbose=0)
    with pytest.raises(PrivacyBudgetExceededError, match="2 more steps"):
        _fit(model, [callback], epochs=1)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert ledger.epsilon() <= ledger.target_epsilon


def test_a_shuffled_run_runs_the_steps_its_plan_calibrated_for():
    """n = 330, batch 64: the plan counts round(1/q) = 5 steps an epoch; shuffled batches used to run
    ceil(330 / 64) = 6, so a run at its target was refused ("needs epsilon=2.18 > 2")."""
    import sparta_tf

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(330, 8)).astype(np.float32), rng.integers(0, 3, 330)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(3)])
    dp = sparta_tf.make_private(model, method="all", target_epsilon=2.0, delta=1e-3, epochs=3, batch_size=64,
                                dataset_size=330, seed=0, sampling="shuffle", accountant="rdp")
    dp.compile(tf.keras.optimizers.SGD(0.1),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dp.fit(x, y, verbose=0)
    assert int(dp.dp_step.numpy()) == dp.plan.steps == 15 and dp.ledger.steps == 15
