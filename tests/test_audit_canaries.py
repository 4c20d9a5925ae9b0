"""Canaries (coin flips, kinds, the planted training set), canary losses and the audit report."""

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.audit import CANARY_KINDS, SCORES, Canaries, LossRecorder, audit_report, canary_scores, plant_canaries
from sparta_tf import random_streams
from sparta_tf.audit import canaries as data_canaries
from sparta_tf.audit import gradient_canaries, per_example_loss, summary_line
from sparta_tf.audit.gradient_canaries import GradientCanaries
from sparta_tf.data.dataset import Dataset
from trainers import audit as audit_cli


def _dataset(n=200, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, 4, 4, 1)).astype(np.float32)
    y = rng.integers(0, classes, n)
    return Dataset(x, y, x[:10], y[:10], x[:20], y[:20], classes, [str(k) for k in range(classes)], "toy")


def _rows(x):
    return {row.tobytes() for row in x}


@pytest.mark.parametrize("kind", ["mislabelled", "clean"])
def test_included_canaries_are_trained_on_and_the_others_are_not_there_at_all(kind):
    data = _dataset()
    planted, canaries = plant_canaries(data, 60, kind, seed=3)
    assert len(planted.y_train) == 200 - 60 + canaries.included.sum()
    train = _rows(planted.x_train)
    pairs = set(zip((r.tobytes() for r in planted.x_train), planted.y_train.tolist()))
    for x, y, inside in zip(canaries.x, canaries.y, canaries.included):
        assert (x.tobytes() in train) == bool(inside)
        if inside:
            assert (x.tobytes(), int(y)) in pairs  # trained with the canary label
    np.testing.assert_array_equal(np.sort(canaries.train_rows),
                                  np.flatnonzero([r.tobytes() in _rows(canaries.x) for r in planted.x_train]))
    assert planted.x_test is data.x_test and planted.x_val is data.x_val


def test_mislabelled_canaries_never_keep_their_true_label():
    data = _dataset()
    _, canaries = plant_canaries(data, 80, "mislabelled", seed=1)
    true = {x.tobytes(): y for x, y in zip(data.x_train, data.y_train)}
    assert all(true[x.tobytes()] != y for x, y in zip(canaries.x, canaries.y))
    assert set(canaries.y.tolist()) == set(range(4))


def test_noise_canaries_are_new_images_in_the_data_range_and_take_nothing_away():
    data = _dataset()
    planted, canaries = plant_canaries(data, 300, "noise", seed=0)
    assert len(planted.y_train) == 200 + canaries.included.sum()
    assert not _rows(canaries.x) & _rows(data.x_train)
    assert data.x_train.min() <= canaries.x.min() and canaries.x.max() <= data.x_train.max()
    assert canaries.x.shape[1:] == data.x_train.shape[1:] and canaries.x.dtype == data.x_train.dtype


def test_coin_flips_come_from_their_own_seeded_stream():
    data = _dataset()
    first, again, other = (plant_canaries(data, 80, seed=s)[1] for s in (5, 5, 6))
    np.testing.assert_array_equal(first.included, again.included)
    np.testing.assert_array_equal(first.x, again.x)
    assert not np.array_equal(first.included, other.included)
    flips = np.concatenate([plant_canaries(data, 100, seed=s)[1].included for s in range(20)])
    assert abs(flips.mean() - 0.5) < 0.03  # Bernoulli(1/2): 2,000 flips, ~4.5 std


def _longest_agreement(first: np.ndarray, second: np.ndarray, overlap: int = 50) -> float:
    """The largest share of equal pairs ``first[i] == second[i + shift]`` over the shifts with >= ``overlap`` pairs."""
    best = 0.0
    for shift in range(-(len(first) - overlap), len(second) - overlap + 1):
        start, stop = max(0, -shift), min(len(first), len(second) - shift)
        if stop - start >= overlap:
            best = max(best, float(np.mean(first[start:stop] == second[start + shift:stop + shift])))
    return best


def test_data_and_gradient_canaries_flip_their_coins_from_streams_of_their_own():
    """Regression: both kinds drew from the ``canaries`` stream of one seed, so with the defaults of a run with
    both (324 data canaries of 648 examples, 320 gradient canaries on a 64 x 5 head) data canary i's coin was
    gradient canary i + 167's for 153 pairs. The black-box bound needs each data canary's coin flip independent
    of everything else in the run."""
    head = tf.Variable(tf.zeros([64, 5]))
    for seed in range(3):
        data = plant_canaries(_dataset(n=648, classes=5), 324, seed=seed)[1].included
        gradient = GradientCanaries(head, 320, seed, clip_norm=1.0).included
        assert _longest_agreement(data, gradient) <= 0.9, seed  # independent coins: ~0.5 (0.9 is 5.7 std over 50)
    assert random_streams.domain(gradient_canaries.STREAM) != random_streams.domain(data_canaries.CANARY_STREAM)


@pytest.mark.parametrize("count, kind, message", [
    (1, "mislabelled", ">= 2"), (101, "mislabelled", "at most 100"), (50, "poison", "unknown"),
])
def test_bad_canary_requests_are_refused_with_the_fix(count, kind, message):
    with pytest.raises(ValueError, match=message):
        plant_canaries(_dataset(), count, kind)


def test_cli_names_the_same_kinds_and_scores_as_the_library():
    assert audit_cli.CANARY_KINDS == CANARY_KINDS and audit_cli.SCORES == SCORES


def _logit_model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((4, 4, 1)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(4)])


def test_per_example_loss_is_the_cross_entropy_of_the_logits():
    model, data = _logit_model(), _dataset(n=10)
    logits = model(data.x_train).numpy()
    expected = -np.log(np.exp(logits) / np.exp(logits).sum(1, keepdims=True))[np.arange(10), data.y_train]
    np.testing.assert_allclose(per_example_loss(model, data.x_train, data.y_train, batch_size=3), expected, rtol=1e-5)


def test_loss_recorder_sees_the_model_before_the_first_step_and_after_the_last():
    model, data = _logit_model(), _dataset(n=64)
    before = per_example_loss(model, data.x_train, data.y_train)
    recorder = LossRecorder(data.x_train, data.y_train)
    model.compile(tf.keras.optimizers.SGD(0.5), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data.x_train, data.y_train, epochs=5, verbose=0, callbacks=[recorder])
    np.testing.assert_allclose(recorder.start, before, rtol=1e-6)
    np.testing.assert_allclose(recorder.end, per_example_loss(model, data.x_train, data.y_train), rtol=1e-6)
    assert recorder.end.mean() < recorder.start.mean()
    np.testing.assert_allclose(canary_scores(recorder.start, recorder.end, "loss_drop"), recorder.start - recorder.end)
    np.testing.assert_allclose(canary_scores(recorder.start, recorder.end, "loss"), -recorder.end)


def _canaries(included):
    m = len(included)
    return Canaries(x=np.zeros((m, 1)), y=np.zeros(m, int), included=np.asarray(included), kind="mislabelled",
                    seed=0, train_rows=np.zeros(0, int))


def test_report_flags_a_run_whose_canaries_give_themselves_away():
    rng = np.random.default_rng(0)
    included = rng.random(400) < 0.5
    leaky = np.where(included, 0.01, 3.0) + 0.001 * rng.random(400)  # members: loss ~0
    report = audit_report(_canaries(included), np.full(400, 2.0), leaky, delta=1e-5, epsilon_claimed=1.0)
    assert report["epsilon_lower_bound"] > 1.0 and report["passed"] is False
    assert report["mia_auc"] == 1.0 and report["mia_tpr_at_fpr_1e-3"] == 1.0
    assert "CONTRADICTS" in summary_line(report)
    blind = audit_report(_canaries(included), np.full(400, 2.0), 3.0 + rng.random(400), delta=1e-5,
                         epsilon_claimed=1.0)
    assert blind["epsilon_lower_bound"] < 1.0 and blind["passed"] is True
    for key in ("epsilon_claimed", "epsilon_lower_bound", "confidence", "canaries", "mia_auc", "mia_tpr_at_fpr_1e-3"):
        assert key in blind


def test_report_refuses_mismatched_losses():
    with pytest.raises(ValueError, match="one start and one end loss per canary"):
        audit_report(_canaries([True, False, True]), np.zeros(3), np.zeros(2), delta=1e-5, epsilon_claimed=1.0)
