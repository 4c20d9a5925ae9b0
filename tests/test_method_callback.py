"""MethodCallback runs a method as named or refuses with one line (issue 40, item 7).

DP-FROST chooses its partitions and DP-SSGD pre-prunes before training
(``method.prepare``), and DP-SSGD's gradient dropping needs the
``SSGDModel`` that ``method.make_dp_model`` builds. Without them a fit would
train something else (or crash), so ``MethodCallback`` refuses; with them the
library sequence trains exactly the method's set.
"""

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf import ssgd
from sparta_tf.methods import make_method
from sparta_tf.privacy.plan import make_privacy_plan
from small_models import LOSS, small_data, small_mlp

N, BATCH, EPOCHS = 64, 16, 2


def _plan(method):
    """As sparta-train's make_plan: the method's phases, mechanisms before training and budget share."""
    return make_privacy_plan(
        n=N, expected_batch_size=BATCH, phases=method.phases(EPOCHS), delta=1e-5, target_epsilon=8.0,
        before_training=method.mechanisms_before_training(N, BATCH / N), training_share=method.training_share,
        nonprivate_reasons=method.nonprivate_reasons())


def _dp(method, model, plan):
    dp = method.make_dp_model(model, noise_multiplier=plan.noise_multiplier, sample_rate=plan.sample_rate,
                              dataset_size=plan.n, delta=plan.delta, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    return dp


def _plain_dp(model):
    dp = sparta_tf.DPModel(model, noise_multiplier=1.0, sample_rate=BATCH / N, dataset_size=N, delta=1e-5, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    return dp


def _refusal(dp, method) -> str:
    x, y = small_data(N)
    before = [v.numpy() for v in dp.model.weights]
    with pytest.raises(ValueError) as error:
        dp.fit(x, y, epochs=1, callbacks=[sparta_tf.callbacks.MethodCallback(method)], verbose=0)
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, dp.model.weights))  # nothing trained
    return str(error.value)


def test_dp_frost_without_prepare_refuses_in_one_line():
    message = _refusal(_plain_dp(small_mlp()), make_method("dp_frost", verbose=0))
    assert "\n" not in message
    assert "'dp_frost'" in message and "method.prepare(dp, x, y, loss, plan)" in message


def test_dp_ssgd_on_a_plain_dp_model_refuses_in_one_line():
    message = _refusal(_plain_dp(small_mlp()), make_method("dp_ssgd", prune="random", verbose=0))
    assert "\n" not in message
    assert "'dp_ssgd'" in message and "SSGDModel" in message and "method.make_dp_model" in message


def test_dp_ssgd_prepare_on_a_plain_dp_model_refuses_in_one_line():
    x, y = small_data(N)
    method = make_method("dp_ssgd", prune="random", verbose=0)
    with pytest.raises(ValueError, match="SSGDModel") as error:
        method.prepare(_plain_dp(small_mlp()), x, y, LOSS, _plan(method))
    assert "\n" not in str(error.value)


def test_dp_ssgd_without_pruning_still_refuses_a_plain_dp_model():
    message = _refusal(_plain_dp(small_mlp()), make_method("dp_ssgd", prune="none", verbose=0))
    assert "\n" not in message and "SSGDModel" in message and "prepare" not in message


def test_dp_ssgd_unprepared_ssgd_model_refuses():
    method = make_method("dp_ssgd", prune="random", verbose=0)
    model = small_mlp()
    message = _refusal(_dp(method, model, _plan(method)), method)
    assert "\n" not in message and "method.prepare(dp, x, y, loss, plan)" in message


def test_prepare_for_another_dp_model_does_not_count():
    method = make_method("dp_frost", gamma=0.3, q_ps=0.25, frost_iterations=2, verbose=0)
    x, y = small_data(N)
    plan = _plan(method)
    method.prepare(_dp(method, small_mlp(), plan), x, y, LOSS, plan)
    message = _refusal(_dp(method, small_mlp(), plan), method)
    assert "method.prepare did not run for this model" in message


def test_dp_frost_prepared_trains_exactly_the_selected_partitions():
    method = make_method("dp_frost", gamma=0.3, q_ps=0.25, frost_iterations=2, verbose=0)
    model = small_mlp()
    x, y = small_data(N)
    plan = _plan(method)
    dp = _dp(method, model, plan)
    method.prepare(dp, x, y, LOSS, plan)
    before = {id(v): v.numpy() for v in model.weights}
    dp.fit(x, y, epochs=EPOCHS, callbacks=[sparta_tf.callbacks.MethodCallback(method)], verbose=0)

    selected = {id(v) for v in method.selected.variables}
    assert [id(v) for v in dp.trainable_set.variables] == [id(v) for v in method.selected.variables]
    assert dp.trainable_set.size == method.selected.size < sum(v.shape.num_elements() for v in model.weights)
    for v in model.weights:
        if id(v) in selected:
            assert not np.array_equal(before[id(v)], v.numpy()), v.name
        else:
            np.testing.assert_array_equal(before[id(v)], v.numpy(), err_msg=v.name)
    assert {e.phase for e in dp.ledger.entries} >= {"frost_selection", "dp_frost"}


def test_dp_ssgd_prepared_trains_the_pre_pruned_set():
    method = make_method("dp_ssgd", prune="random", prune_rate=0.5, drop_rate=0.5, verbose=0)
    model = small_mlp()
    x, y = small_data(N)
    plan = _plan(method)
    dp = _dp(method, model, plan)
    assert isinstance(dp, ssgd.SSGDModel)
    method.prepare(dp, x, y, LOSS, plan)
    keep = dp.keep_masks_pp
    before = {id(v): v.numpy() for v in model.weights}
    history = dp.fit(x, y, epochs=EPOCHS, callbacks=[sparta_tf.callbacks.MethodCallback(method)], verbose=0)

    total = sum(v.shape.num_elements() for v in model.trainable_variables)
    pruned = sum(int((~m).sum()) for _, m in keep)
    assert pruned > 0
    assert dp.trainable_set.size == total - pruned
    assert history.history["trainable_fraction"][-1] == pytest.approx((total - pruned) / total)
    for v, m in keep:  # pruned weights were zeroed and stay bit-identical zeros; kept ones train
        w = v.numpy()
        np.testing.assert_array_equal(w[~m], np.zeros_like(w[~m]))
        np.testing.assert_array_equal(before[id(v)][~m], w[~m])
        assert not np.array_equal(before[id(v)][m], w[m]), v.name


def test_bitfit_runs_without_prepare():
    model = small_mlp()
    x, y = small_data(N)
    dp = _plain_dp(model)
    before = {id(v): v.numpy() for v in model.weights}
    dp.fit(x, y, epochs=1, callbacks=[sparta_tf.callbacks.MethodCallback("bitfit", verbose=0)], verbose=0)
    for layer in model.layers:
        kernel_changed = not np.array_equal(before[id(layer.kernel)], layer.kernel.numpy())
        assert kernel_changed == (layer.name == "head")
        assert not np.array_equal(before[id(layer.bias)], layer.bias.numpy())
