"""The DP-SGD step: clipping bound, padding, noise, frozen coordinates, equivalences."""

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.dp_step.clipping import clipped_sum
from sparta_tf.dp_model import DPModel
from sparta_tf.losses import per_example_loss_fn
from sparta_tf.model_checks import NotPerExampleSafeError
from sparta_tf.per_example import make_engine
from small_models import LOSS, conv_gn_model, gaussian_data
from small_models import variable_name as key
from two_replicas import two_cpu_replicas

L = tf.keras.layers
PER_EXAMPLE_LOSS = per_example_loss_fn(LOSS)


def unnormalised_model(seed=0):
    """No normalisation layer, so huge inputs give huge gradients."""
    tf.keras.utils.set_random_seed(seed)
    inputs = L.Input((6, 6, 2))
    h = L.Conv2D(4, 3, padding="same", name="conv")(inputs)
    h = L.GlobalAveragePooling2D()(h)
    return tf.keras.Model(inputs, L.Dense(3, name="head")(h))


def data(n=16, seed=0):
    x, y = gaussian_data(n, (6, 6, 2), 3, seed)
    return x, y.astype("int32")


def one_step(dp, x, y, w):
    dp.train_step((tf.constant(x), tf.constant(y), tf.constant(w, tf.float32)))


def weights_of(model):
    return [v.numpy().copy() for v in model.weights]


@pytest.mark.parametrize("engine", ["layerwise", "vectorized"])
def test_clip_bound_holds_for_adversarial_examples(engine):
    model = unnormalised_model()
    x, y = data(8)
    x[:4] *= 1e4  # huge activations -> huge gradients
    grads = make_engine(model, model.trainable_variables, engine)(
        tf.constant(x), tf.constant(y), PER_EXAMPLE_LOSS, tf.ones([8], bool)
    ).grads
    norms = np.sqrt(sum(np.sum(np.square(g.numpy()).reshape(8, -1), 1) for g in grads))
    assert (norms[:4] > 100).sum() >= 3  # really adversarial
    clip = 0.5
    for i in range(8):  # contribution of example i alone
        alone = np.zeros(8, bool)
        alone[i] = True
        sums, _ = clipped_sum(grads, clip, tf.constant(alone))
        contribution = np.sqrt(sum(np.sum(np.square(s.numpy())) for s in sums))
        assert contribution <= clip
        if norms[i] > clip:
            assert contribution > clip * (1 - 1e-5)  # clipped, not dropped


def test_non_finite_and_padded_examples_contribute_exactly_zero():
    grads = [tf.constant([[1.0, 2.0], [np.nan, 1.0], [np.inf, 0.0], [3.0, 4.0]])]
    valid = tf.constant([True, True, True, False])
    sums, _ = clipped_sum(grads, 10.0, valid)
    np.testing.assert_array_equal(sums[0].numpy(), [1.0, 2.0])


@pytest.mark.parametrize("engine", ["layerwise", "vectorized"])
def test_padding_contributes_exactly_zero_in_a_step(engine):
    x, y = data(8)
    garbage = np.full((8, 6, 6, 2), 1e30, np.float32)  # would overflow if it leaked
    results = []
    for xs, ys, ws in [
        (x, y, np.ones(8)),
        (np.concatenate([x, garbage]), np.concatenate([y, y]), np.r_[np.ones(8), np.zeros(8)]),
    ]:
        model = conv_gn_model()
        dp = DPModel(model, noise_multiplier=0.0, sample_rate=1.0, dataset_size=8, engine=engine, seed=3)
        dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
        one_step(dp, xs, ys, ws)
        results.append(weights_of(model))
    for a, b in zip(*results):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_all_padding_batch_has_zero_clipped_sum():
    model = conv_gn_model()
    engine = make_engine(model, model.trainable_variables, materialise=True)
    x, y = data(4)
    result = engine(tf.constant(x), tf.constant(y), PER_EXAMPLE_LOSS, tf.zeros([4], bool))
    sums, _ = clipped_sum(result.grads, 1.0, tf.zeros([4], bool))
    assert all(np.count_nonzero(s.numpy()) == 0 for s in sums)


@pytest.mark.parametrize("engine", ["layerwise", "vectorized"])
def test_no_noise_no_clipping_equals_plain_mean_gradient_step(engine):
    x, y = data(16)
    plain = conv_gn_model()
    with tf.GradientTape() as tape:
        loss = LOSS(y, plain(x, training=True))
    grads = tape.gradient(loss, plain.trainable_variables)
    tf.keras.optimizers.SGD(0.3).apply_gradients(zip(grads, plain.trainable_variables))

    model = conv_gn_model()
    dp = DPModel(model, noise_multiplier=0.0, clip_norm=1e9, sample_rate=1.0, dataset_size=16, engine=engine)
    dp.compile(tf.keras.optimizers.SGD(0.3), loss=LOSS)
    one_step(dp, x, y, np.ones(16))
    for a, b in zip(weights_of(plain), weights_of(model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_micro_batches_accumulate_to_the_full_batch_step():
    x, y = data(16)
    results = []
    for physical in (None, 4):
        model = conv_gn_model()
        dp = DPModel(model, noise_multiplier=0.7, sample_rate=0.5, dataset_size=32,
                     physical_batch_size=physical, seed=11)
        dp.compile(tf.keras.optimizers.SGD(0.2), loss=LOSS)
        one_step(dp, x, y, np.r_[np.ones(13), np.zeros(3)])
        results.append(weights_of(model))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_noise_std_on_trainable_coordinates_and_zero_elsewhere():
    tf.keras.utils.set_random_seed(0)
    inputs = L.Input((40,))
    h = L.Dense(300, name="frozen_by_set")(inputs)
    h = L.Dense(200, name="noised")(h)
    frozen_layer = L.Dense(10, name="frozen_layer", trainable=False)
    model = tf.keras.Model(inputs, L.Dense(3, name="head")(frozen_layer(h)))
    sigma, clip, q, n, lr = 1.3, 0.7, 0.05, 400, 1.0
    dp = DPModel(model, noise_multiplier=sigma, clip_norm=clip, sample_rate=q, dataset_size=n, seed=5)
    noised = model.get_layer("noised")
    dp.set_dp_variables([noised.kernel, noised.bias])
    dp.compile(tf.keras.optimizers.SGD(lr), loss=LOSS)
    before = {key(v): v.numpy().copy() for v in model.weights}
    x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
    dp.train_step((tf.constant(x), tf.zeros([8], tf.int32), tf.zeros([8])))  # all padding: update = noise
    expected_std = lr * sigma * clip / (q * n)
    for v in model.weights:
        delta = v.numpy() - before[key(v)]
        if v is noised.kernel:
            assert abs(delta.std() / expected_std - 1) < 0.03
            assert abs(delta.mean()) < 4 * expected_std / np.sqrt(delta.size)
        elif v is not noised.bias:
            np.testing.assert_array_equal(delta, 0)  # bit-identical


def test_noise_is_reproducible_and_fresh_each_step():
    x, y = data(4)
    updates = []
    for _ in range(2):
        model = conv_gn_model()
        dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.5, dataset_size=8, seed=42)
        dp.compile(tf.keras.optimizers.SGD(1.0), loss=LOSS)
        w0 = weights_of(model)
        one_step(dp, x, y, np.zeros(4))
        w1 = weights_of(model)
        one_step(dp, x, y, np.zeros(4))
        w2 = weights_of(model)
        updates.append((w1[0] - w0[0], w2[0] - w1[0]))
    np.testing.assert_array_equal(updates[0][0], updates[1][0])
    assert not np.allclose(updates[0][0], updates[0][1])


def test_batchnorm_in_training_mode_is_rejected_and_frozen_is_allowed():
    inputs = L.Input((4,))
    bn = L.BatchNormalization(name="bn")
    model = tf.keras.Model(inputs, L.Dense(2)(bn(inputs)))
    with pytest.raises(NotPerExampleSafeError, match="replace_batchnorm.*groupnorm.*trainable = False"):
        DPModel(model, noise_multiplier=1.0, sample_rate=0.1)
    bn.trainable = False
    DPModel(model, noise_multiplier=1.0, sample_rate=0.1)


def _centred_loss(y, predictions):
    """Mixes the batch: each prediction centred on the batch's mean."""
    centred = predictions - tf.reduce_mean(predictions, axis=0, keepdims=True)
    return tf.reduce_sum(tf.square(centred - tf.one_hot(tf.cast(y, tf.int32), 2)), axis=-1)


@pytest.mark.parametrize("loss, message", [(_centred_loss, "mixes the examples of a batch"),
                                           (lambda y, p: tf.reduce_mean(tf.square(p)), "one value per example")])
def test_a_loss_that_mixes_examples_or_reduces_the_batch_is_refused_before_a_step(loss, message):
    """Such a loss lets one example move every other example's clipped term (the coverage check cannot see
    it: the per-example gradients still sum to the batch gradient)."""
    inputs = L.Input((4,))
    model = tf.keras.Model(inputs, L.Dense(2)(inputs))
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.5, dataset_size=8, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=loss)
    x, y = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32), np.arange(8) % 2
    with pytest.raises(NotPerExampleSafeError, match=message):
        dp.fit(x, y, verbose=0)
    assert int(dp.dp_step.numpy()) == 0


def test_regularization_losses_are_refused():
    inputs = L.Input((4,))
    model = tf.keras.Model(inputs, L.Dense(2, kernel_regularizer="l2")(inputs))
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.5, dataset_size=4)
    dp.compile("sgd", loss=LOSS)
    with pytest.raises(ValueError, match="weight_decay"):
        dp.train_step((tf.zeros([2, 4]), tf.zeros([2], tf.int32), tf.ones([2])))


def test_frozen_coordinates_bit_identical_after_fit_with_momentum():
    model = conv_gn_model()
    x, y = data(64)
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.25, physical_batch_size=8, seed=2)
    head = model.get_layer("head")
    dp.set_dp_variables([head.kernel, head.bias])
    dp.compile(tf.keras.optimizers.SGD(0.5, momentum=0.9), loss=LOSS, metrics=["accuracy"])
    before = {key(v): v.numpy().copy() for v in model.weights}
    dp.fit(x, y, epochs=2, verbose=0)
    assert int(dp.dp_step.numpy()) == 8
    for v in model.weights:
        if v is head.kernel or v is head.bias:
            assert not np.array_equal(v.numpy(), before[key(v)])
        else:
            np.testing.assert_array_equal(v.numpy(), before[key(v)])


def test_jit_compile_runs_and_matches_graph_mode():
    """With noise off (XLA's stateless normal may differ bitwise), XLA and graph agree."""
    x, y = data(8)
    results = []
    for jit in (False, True):
        model = conv_gn_model()
        dp = DPModel(model, noise_multiplier=0.0, sample_rate=0.5, dataset_size=16, seed=9,
                     jit_compile=jit, engine="vectorized")
        dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
        dp.fit(tf.data.Dataset.from_tensors((x, y, np.ones(8, np.float32))), epochs=1, steps_per_epoch=1, verbose=0)
        results.append(weights_of(model))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("made_by", ["hand", "other_rate", "sampler"])
def test_fit_on_a_dataset_the_sampler_did_not_make_for_this_rate_is_a_ledger_caveat(made_by):
    """The ledger charges Poisson sampling at q; a tf.data.Dataset fed to fit as given could be fixed
    batches or another rate, so unless PoissonSampler(n, q) made it, unchanged, the ledger says so."""
    from sparta_tf.privacy.sampling import PoissonSampler

    x, y = data(16)
    dp = DPModel(conv_gn_model(), noise_multiplier=1.0, sample_rate=0.25, dataset_size=16, physical_batch_size=8,
                 delta=1e-3, seed=3)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    datasets = {"hand": lambda: tf.data.Dataset.from_tensors((x[:8], y[:8], np.ones(8, np.float32))).repeat(),
                "other_rate": lambda: PoissonSampler(16, 0.5, 8, seed=3).dataset(x, y),
                "sampler": lambda: PoissonSampler(16, 0.25, 8, seed=3).dataset(x, y)}
    dp.fit(datasets[made_by](), epochs=1, steps_per_epoch=2, verbose=0)
    caveats = [c for c in dp.ledger.caveats() if c.startswith("fit got")]
    if made_by == "sampler":
        assert caveats == []
    else:
        expected = ("PoissonSampler did not make" if made_by == "hand"
                    else "PoissonSampler(n=16, sample_rate=0.5)")
        assert len(caveats) == 1 and expected in caveats[0] and "n=16 examples at q=0.25" in caveats[0]
        assert dp.ledger.report().count(caveats[0]) == 1


def test_a_sampler_dataset_of_other_steps_than_the_models_next_is_refused_before_a_step():
    """Each iteration of a dataset starts at its first element: given to a second fit, the sampler's
    dataset would sample the first fit's steps again (the same batches, so not independent draws)."""
    from sparta_tf.privacy.sampling import PoissonSampler

    x, y = data(16)
    dp = DPModel(conv_gn_model(), noise_multiplier=1.0, sample_rate=0.25, dataset_size=16, physical_batch_size=8,
                 delta=1e-3, seed=3)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    sampler = PoissonSampler(16, 0.25, 8, seed=3)
    first = sampler.dataset(x, y)
    dp.fit(first, epochs=1, steps_per_epoch=2, verbose=0)
    charged = [e.count for e in dp.ledger.entries]
    weights = [w.numpy() for w in dp.model.weights]
    with pytest.raises(ValueError, match="first element is step 0, but this model's next DP step is 2.*start_step="):
        dp.fit(first, epochs=1, steps_per_epoch=2, verbose=0)
    assert [e.count for e in dp.ledger.entries] == charged and int(dp.dp_step.numpy()) == 2
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(weights, dp.model.weights))
    dp.fit(sampler.dataset(x, y, start_step=int(dp.dp_step.numpy())), epochs=1, steps_per_epoch=2, verbose=0)
    assert int(dp.dp_step.numpy()) == 4 and not [c for c in dp.ledger.caveats() if c.startswith("fit got")]


def test_mirrored_strategy_matches_single_device():
    two_replicas = two_cpu_replicas()
    x, y = data(16)
    w = np.r_[np.ones(13), np.zeros(3)].astype("float32")
    element = tf.data.Dataset.from_tensors((x, y, w))
    results = []
    for strategy in (tf.distribute.get_strategy(), two_replicas):
        with strategy.scope():
            model = conv_gn_model()
            dp = DPModel(model, noise_multiplier=0.8, sample_rate=0.5, dataset_size=32,
                         physical_batch_size=8, seed=4)
            dp.compile(tf.keras.optimizers.SGD(0.2, momentum=0.9), loss=LOSS)
        dp.fit(element.repeat(), epochs=1, steps_per_epoch=2, verbose=0)
        results.append(weights_of(model))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [5, 7])
def test_an_evaluation_split_unevenly_over_replicas_matches_single_device(n):
    """At batch 4, 5 examples leave one replica no example of the last batch, on which Keras 2's
    GroupNormalization fails (found as a multi-worker run whose secret split left such a batch); 7 split it
    2 and 1, which Keras 3 weighed wrongly (it averaged the replicas' metric results)."""
    two_replicas = two_cpu_replicas()
    x, y = data(n)
    results = []
    for strategy in (tf.distribute.get_strategy(), two_replicas):
        with strategy.scope():
            dp = DPModel(conv_gn_model(), noise_multiplier=0.8, sample_rate=0.5, dataset_size=32, seed=4)
            dp.compile(tf.keras.optimizers.SGD(0.2), loss=LOSS, metrics=["accuracy"])
        results.append(dp.evaluate(x, y, batch_size=4, verbose=0))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5)


def test_a_prediction_whose_last_batch_leaves_a_replica_no_example_matches_single_device():
    two_replicas = two_cpu_replicas()
    x, _ = data(5)
    predictions = []
    for strategy in (tf.distribute.get_strategy(), two_replicas):
        with strategy.scope():
            dp = DPModel(conv_gn_model(), noise_multiplier=0.8, sample_rate=0.5, dataset_size=32, seed=4)
        predictions.append(dp.predict(x, batch_size=4, verbose=0))
    assert predictions[1].shape == (5, 3)
    np.testing.assert_allclose(predictions[0], predictions[1], rtol=1e-5, atol=1e-6)


def test_step_is_traced_once_with_compiled_metrics():
    """Metric variables are built before the first call, so tf.function traces the DP step once
    (a first trace that creates variables makes it trace a second time)."""
    traces = []

    class CountingDPModel(DPModel):
        def train_step(self, data):
            traces.append(1)  # runs at trace time only
            return super().train_step(data)

    x, y = data(64)
    dp = CountingDPModel(conv_gn_model(), noise_multiplier=1.0, sample_rate=0.25, physical_batch_size=16, seed=3)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS, metrics=["accuracy"])
    history = dp.fit(x, y, epochs=2, verbose=0)
    assert len(traces) == 1
    # the eagerly built metric is the sparse one and is updated by the steps
    assert sorted(history.history) == ["accuracy", "loss", "non_finite"]
    assert all(0.0 <= a <= 1.0 for a in history.history["accuracy"])
    assert history.history["accuracy"][0] > 0.0


@pytest.mark.parametrize("micro", [None, 8])
def test_metrics_count_only_real_examples_not_padding(micro):
    """Padding rows (weight 0) are left out of the compiled metrics as of the loss: Keras hands
    sample weights to weighted metrics only, so DPModel compiles every metric as weighted."""
    model = conv_gn_model()
    x, y = data(32)
    real = 20
    logits = model(x).numpy()
    y = y.copy()
    y[real:] = logits[real:].argmax(1)  # padding rows that a count of rows would score as correct
    x_pad = x.copy()
    w = np.r_[np.ones(real), np.zeros(32 - real)].astype("float32")
    dp = DPModel(model, noise_multiplier=0.0, sample_rate=0.5, dataset_size=64, physical_batch_size=micro, seed=1)
    dp.compile(tf.keras.optimizers.SGD(0.0), loss=LOSS, metrics=["accuracy"])
    results = tf.function(dp.train_step)((tf.constant(x_pad), tf.constant(y), tf.constant(w)))
    expected_accuracy = np.mean(logits[:real].argmax(1) == y[:real])
    expected_loss = np.mean(PER_EXAMPLE_LOSS(tf.constant(y[:real]), tf.constant(logits[:real])).numpy())
    assert float(results["accuracy"]) == pytest.approx(expected_accuracy)
    assert float(results["loss"]) == pytest.approx(expected_loss, rel=1e-5)


def test_metrics_and_weighted_metrics_are_merged_or_refused():
    dp = DPModel(conv_gn_model(), noise_multiplier=1.0, sample_rate=0.5, dataset_size=8)
    dp.compile("sgd", loss=LOSS, metrics=["accuracy"], weighted_metrics=[tf.keras.metrics.SparseTopKCategoricalAccuracy(2)])
    x, y = data(8)
    history = dp.fit(x, y, epochs=1, verbose=0)
    assert sorted(history.history) == ["accuracy", "loss", "non_finite", "sparse_top_k_categorical_accuracy"]
    with pytest.raises(ValueError, match="not both"):
        dp.compile("sgd", loss=LOSS, metrics={"head": ["accuracy"]}, weighted_metrics=["accuracy"])
