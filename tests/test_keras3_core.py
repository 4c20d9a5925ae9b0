"""The DP core on whichever Keras tf.keras is (Keras 3 with the TensorFlow backend, or Keras 2).

Run on Keras 3 with ``requirements/keras3.txt`` (``sparta_tf.backend.KERAS3`` true); it runs on Keras 2 too.
Two small models written the usual way, a Dense MLP and a Conv2D + GroupNorm net:

* every engine's clipped sum ``sum_i g_i min(1, C / ||g_i||)`` equals the one-example tape reference
  (float64), for whole variables and for selected rows (norms over the trainable coordinates only);
* one step of ``DPModel.fit`` with ``sigma = 0`` and ``SGD(1)`` moves the weights by ``-S / (q n)``,
  padding rows (NaN inputs) contributing exactly zero;
* ``fit`` on arrays (Poisson sampling, micro-batches, momentum, ledger) writes only the selected rows:
  every other coordinate stays bit-identical; the ledger charges every step;
* the noise on a trainable coordinate has std ``lr sigma C / (q n)``, and is zero elsewhere;
* the masked optimizer equals Keras' own SGD (momentum) / Adam on whole variables;
* ``checkpoint_state`` round-trips through ``tf.train.Checkpoint``;
* SPARTA's three phases through ``SpartaCallback`` (warm-up on the always-trainable set, a selection
  epoch that writes no weight, the sparse phase on the selected rows), and DP-BiTFiT's bias set.
"""

import numpy as np
import pytest
import tensorflow as tf

from layer_zoo import loss_fn, norms, reference_clipped_sum, reference_gradients
from small_models import LOSS, conv_gn_model
import sparta_tf as st
from sparta_tf import backend, trainable
from sparta_tf.groups import parameter_table
from sparta_tf.dp_model import DPModel
from sparta_tf.groups import row_groups
from sparta_tf.methods.sets import bias_terms_set
from sparta_tf.optim.masked_optimizer import MaskedOptimizer
from sparta_tf.per_example import make_engine
from sparta_tf.per_example.bookkeeping import clipped_batch
from sparta_tf.privacy.accounting import compute_epsilon
from sparta_tf.trainable import TrainableSet

L = tf.keras.layers
CLASSES = 3


def mlp(seed: int = 0) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    inputs = L.Input((10,))
    h = L.Dense(8, activation="relu", name="hidden")(inputs)
    h = L.Dense(6, activation="tanh", name="hidden2")(h)
    return tf.keras.Model(inputs, L.Dense(CLASSES, name="head")(h))


MODELS = {"mlp": (mlp, (10,)), "conv_gn": (lambda: conv_gn_model(classes=CLASSES), (6, 6, 2))}


def batch(model_name: str, real: int, padding: int = 0, seed: int = 1):
    """``(x, y, valid)``: ``real`` examples, then ``padding`` rows of NaN."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(real + padding, *MODELS[model_name][1])).astype("float32")
    x[real:] = np.nan
    y = rng.integers(0, CLASSES, real + padding).astype("int64")
    return x, y, np.arange(real + padding) < real


def key(variable) -> str:
    return backend.variable_key(variable)


def weights_by_key(model) -> dict:
    return {key(v): v.numpy().copy() for v in model.weights}


def some_rows(model) -> TrainableSet:
    """Rows 0 and 2 of every maskable kernel, the head whole (its kernel and bias)."""
    head = model.get_layer("head")
    selections = [trainable.rows(group, [0, 2]) for group in row_groups(model, head)]
    return TrainableSet(selections + [trainable.dense(head.kernel), trainable.dense(head.bias)])


def engine_for(model, selections, name):
    if name == "bookkeeping":
        return make_engine(model, selections, "bookkeeping")
    return make_engine(model, selections, name)


def test_this_is_the_line_the_run_asked_for():
    """Keras 3 where tf.keras is Keras 3 (the keras3 requirements), Keras 2 otherwise."""
    assert backend.KERAS3 == backend.keras_version().startswith("3.")
    assert backend.keras_backend() == "tensorflow"


@pytest.mark.parametrize("engine_name", ["layerwise", "vectorized", "bookkeeping"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_clipped_sum_equals_the_one_example_reference(model_name, engine_name):
    model = MODELS[model_name][0]()
    x, y, valid = batch(model_name, real=6, padding=2)
    reference = reference_gradients(model, x, y, valid)
    clip = float(np.median(norms(reference)))  # some examples clipped, some not
    expected = reference_clipped_sum(reference, clip)
    engine = engine_for(model, model.trainable_variables, engine_name)
    step = tf.function(lambda x, y, v: clipped_batch(engine, x, y, loss_fn, v, clip).sums)
    sums = step(tf.constant(x), tf.constant(y), tf.constant(valid))
    scale = max(float(np.max(np.abs(e))) for e in expected)
    for variable, got, want in zip(model.trainable_variables, sums, expected):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5 * scale, err_msg=key(variable))


@pytest.mark.parametrize("engine_name", ["layerwise", "bookkeeping"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_clipped_sum_over_selected_rows_equals_the_reference(model_name, engine_name):
    """Norms and sums over the trainable coordinates only (rows 0 and 2 of each kernel, the head)."""
    model = MODELS[model_name][0]()
    x, y, valid = batch(model_name, real=6)
    selections = some_rows(model)
    position = {id(v): k for k, v in enumerate(model.trainable_variables)}
    reference = [[s.compact(tf.constant(grads[position[id(s.variable)]])).numpy() for s in selections]
                 for grads in reference_gradients(model, x, y, valid)]
    clip = float(np.median(norms(reference)))
    expected = reference_clipped_sum(reference, clip)
    engine = engine_for(model, selections, engine_name)
    sums = clipped_batch(engine, tf.constant(x), tf.constant(y), loss_fn, tf.constant(valid), clip).sums
    scale = max(float(np.max(np.abs(e))) for e in expected)
    for selection, got, want in zip(selections, sums, expected):
        assert tuple(got.shape) == selection.compact_shape
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5 * scale,
                                   err_msg=key(selection.variable))


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_one_fit_step_moves_the_weights_by_the_clipped_sum_over_q_n(model_name):
    model = MODELS[model_name][0]()
    x, y, valid = batch(model_name, real=6, padding=2)
    reference = reference_gradients(model, x, y, valid)
    clip = float(np.median(norms(reference)))
    expected = reference_clipped_sum(reference, clip)
    q, n = 0.5, 12
    dp = DPModel(model, noise_multiplier=0.0, clip_norm=clip, sample_rate=q, dataset_size=n, seed=0)
    dp.compile(tf.keras.optimizers.SGD(1.0), loss=LOSS, metrics=["accuracy"])
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    dataset = tf.data.Dataset.from_tensors((x, y, valid.astype("float32")))
    history = dp.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)
    assert set(history.history) >= {"loss", "accuracy"}
    scale = max(float(np.max(np.abs(e))) for e in expected) / (q * n)
    for variable, old, total in zip(model.trainable_variables, before, expected):
        moved = variable.numpy().astype(np.float64) - old
        np.testing.assert_allclose(moved, -total / (q * n), atol=1e-5 * scale, err_msg=key(variable))


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_fit_with_poisson_sampling_writes_only_the_selected_rows_and_charges_every_step(model_name):
    model = MODELS[model_name][0]()
    x, y, _ = batch(model_name, real=64, seed=3)
    sigma, q, delta = 1.0, 0.25, 1e-5
    dp = DPModel(model, noise_multiplier=sigma, sample_rate=q, physical_batch_size=8, delta=delta, seed=2)
    selections = some_rows(model)
    dp.set_trainable_set(selections)
    dp.compile(tf.keras.optimizers.SGD(0.5, momentum=0.9), loss=LOSS, metrics=["accuracy"])
    before = weights_by_key(model)
    history = dp.fit(x, y, epochs=2, verbose=0)
    steps = 2 * round(1 / q)
    assert int(dp.dp_step.numpy()) == steps and dp.ledger.steps == steps
    assert history.history["epsilon"][-1] == pytest.approx(compute_epsilon(sigma, q, steps, delta), rel=1e-6)
    assert dp.ledger.caveats() == []  # fit's own Poisson sampler: covered by the accountant
    trained = {id(s.variable): s.dense_mask() for s in selections}
    for variable in model.weights:
        old, new = before[key(variable)], variable.numpy()
        mask = trained.get(id(variable), np.zeros(old.shape, bool))
        np.testing.assert_array_equal(new[~mask], old[~mask], err_msg=f"frozen part of {key(variable)}")
        assert np.all(new[mask] != old[mask]), f"trained part of {key(variable)} did not move"


def test_noise_std_on_selected_rows_and_zero_elsewhere():
    tf.keras.utils.set_random_seed(0)
    inputs = L.Input((40,))
    h = L.Dense(300, name="noised")(inputs)
    model = tf.keras.Model(inputs, L.Dense(CLASSES, name="head")(h))
    sigma, clip, q, n, lr = 1.3, 0.7, 0.05, 400, 1.0
    noised = model.get_layer("noised")
    (group,) = [g for g in row_groups(model, model.get_layer("head"))]
    rows = np.arange(0, 300, 3)
    dp = DPModel(model, noise_multiplier=sigma, clip_norm=clip, sample_rate=q, dataset_size=n, seed=5)
    dp.set_trainable_set(TrainableSet([trainable.rows(group, rows)]))
    dp.compile(tf.keras.optimizers.SGD(lr), loss=LOSS)
    before = weights_by_key(model)
    x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
    dp.train_step((tf.constant(x), tf.zeros([8], tf.int64), tf.zeros([8])))  # all padding: update = noise
    expected_std = lr * sigma * clip / (q * n)
    for variable in model.weights:
        change = variable.numpy() - before[key(variable)]
        if variable is noised.kernel:
            assert abs(change[:, rows].std() / expected_std - 1) < 0.03
            assert abs(change[:, rows].mean()) < 4 * expected_std / np.sqrt(change[:, rows].size)
            others = np.setdiff1d(np.arange(300), rows)
            np.testing.assert_array_equal(change[:, others], 0)
        else:
            np.testing.assert_array_equal(change, 0)


@pytest.mark.parametrize("make_optimizer", [
    lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
    lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    lambda: tf.keras.optimizers.Adam(0.01),
], ids=["momentum", "nesterov", "adam"])
def test_masked_optimizer_equals_the_keras_optimizer_on_whole_variables(make_optimizer):
    ours_model, keras_model = mlp(), mlp()
    masked = MaskedOptimizer(make_optimizer())
    masked.build(TrainableSet.of_variables(ours_model.trainable_variables))
    reference = make_optimizer()
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = [tf.constant(rng.normal(size=v.shape).astype("float32")) for v in ours_model.trainable_variables]
        masked.apply(grads)
        reference.apply_gradients(zip(grads, keras_model.trainable_variables))
    assert int(masked.keras_optimizer.iterations.numpy()) == 3
    for ours, theirs in zip(ours_model.trainable_variables, keras_model.trainable_variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6, err_msg=key(ours))


def test_checkpoint_state_round_trips(tmp_path):
    def trained(seed):
        model = mlp(seed)
        dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.25, seed=seed)
        dp.set_trainable_set(some_rows(model))
        dp.compile(tf.keras.optimizers.SGD(0.5, momentum=0.9), loss=LOSS)
        return dp

    x, y, _ = batch("mlp", real=32, seed=4)
    dp = trained(0)
    dp.fit(x, y, epochs=1, verbose=0)
    path = tf.train.Checkpoint(**dp.checkpoint_state()).write(str(tmp_path / "ckpt"))
    restored = trained(1)  # other weights, other seed, fresh state
    restored.fit(x[:8], y[:8], epochs=1, verbose=0)  # builds everything, then is overwritten
    tf.train.Checkpoint(**restored.checkpoint_state()).read(path).assert_existing_objects_matched()
    for a, b in zip(dp.model.weights, restored.model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(restored.dp_step.numpy()) == int(dp.dp_step.numpy())
    assert int(restored.optimizer.iterations.numpy()) == int(dp.optimizer.iterations.numpy())
    for k in dp._masked_optimizer.slots:
        for a, b in zip(dp._masked_optimizer.slots[k], restored._masked_optimizer.slots[k]):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_sparta_three_phases_freeze_unselected_coordinates(tmp_path):
    model = conv_gn_model(classes=CLASSES)
    x, y, _ = batch("conv_gn", real=64, seed=5)
    q, epochs, warmup = 0.25, 4, 1
    dp = DPModel(model, noise_multiplier=0.8, sample_rate=q, delta=1e-5, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.05, momentum=0.9), loss=LOSS)
    callback = st.callbacks.SpartaCallback(warmup_epochs=warmup, density=0.5, mask_dir=str(tmp_path), verbose=0)
    after_warmup = {}

    class AfterWarmup(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == warmup - 1:
                after_warmup.update(weights_by_key(model))
            if epoch == warmup:  # the selection epoch wrote no weight
                for variable in model.weights:
                    np.testing.assert_array_equal(variable.numpy(), after_warmup[key(variable)], err_msg=key(variable))

    before = weights_by_key(model)
    dp.fit(x, y, epochs=epochs, callbacks=[callback, AfterWarmup()], verbose=0)
    steps = round(1 / q)
    phases = {}
    for entry in dp.ledger.entries:
        phases[entry.phase] = phases.get(entry.phase, 0) + entry.count
    assert phases == {"warmup": steps, "selection": steps, "sparse": (epochs - warmup - 1) * steps}
    mask = {key(s.variable): s for s in callback.mask_selections}
    assert mask and (tmp_path / "mask.npz").exists()
    for info in parameter_table(model):
        name = key(info.variable)
        old, new = before[name], info.variable.numpy()
        if info.group is None:
            assert not np.array_equal(old, new), f"{name} ({info.role}) should train"
            continue
        trained = mask[name].dense_mask()
        assert 0 < trained.sum() < trained.size
        np.testing.assert_array_equal(old[~trained], new[~trained], err_msg=f"frozen coordinates of {name}")
        assert not np.array_equal(old[trained], new[trained])


def test_bias_terms_set_is_the_biases_and_norm_offsets():
    model = conv_gn_model(classes=CLASSES)
    names = {"/".join(key(v).split(":")[0].split("/")[-2:]) for v in bias_terms_set(model).variables}
    assert names == {"conv/bias", "gn/beta", "hidden/bias", "head/bias"}


def test_make_private_runs_sparta_on_the_mlp_within_its_plan():
    model = mlp()
    x, y, _ = batch("mlp", real=64, seed=6)
    before = weights_by_key(model)
    dp = st.make_private(model, method="sparta", target_epsilon=8.0, delta=1e-5, epochs=3, batch_size=16,
                         dataset_size=64, seed=0, warmup_epochs=1, density=0.5)
    dp.compile(tf.keras.optimizers.SGD(0.5, momentum=0.9), loss=LOSS)
    history = dp.fit(x, y, verbose=0)
    assert len(history.history["loss"]) == 3
    assert list(dp.ledger.entries) == dp.plan.events()
    assert dp.ledger.is_private and dp.ledger.epsilon() <= 8.0 * (1 + 1e-9)
    assert any(not np.array_equal(before[key(v)], v.numpy()) for v in model.weights)
