"""Named random streams: one seed, one stream per mechanism, no two mechanisms share noise."""

from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf.dp_model as dp_model_module
import sparta_tf.ssgd as ssgd_module
from sparta_tf import DPModel, random_streams
from sparta_tf.noise import gaussian_noise
from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.privacy.sampling import PoissonSampler

SEED = 1234


def _model():
    tf.keras.utils.set_random_seed(0)
    inputs = tf.keras.Input((6,))
    hidden = tf.keras.layers.Dense(8, activation="relu")(inputs)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(3, name="head")(hidden))


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 6)).astype(np.float32), rng.integers(0, 3, size=32)


class _Recorder:
    """Wraps ``gaussian_noise`` and keeps every tensor it drew."""

    def __init__(self):
        self.draws = []

    def __call__(self, *args, **kwargs):
        noise = gaussian_noise(*args, **kwargs)
        self.draws.append([np.asarray(z).ravel() for z in noise])
        return noise


def test_every_stream_has_its_own_domain_and_unknown_names_fail():
    assert len(set(random_streams.STREAMS.values())) == len(random_streams.STREAMS)
    assert set(random_streams.SECRET_STREAMS) <= set(random_streams.STREAMS)
    with pytest.raises(ValueError, match="unknown random stream 'noize'"):
        random_streams.step_key(SEED, "noize", 0)
    keys = {tuple(random_streams.step_key(SEED, name, 0).numpy()) for name in random_streams.STREAMS}
    assert len(keys) == len(random_streams.STREAMS)


def test_dp_snip_noise_is_independent_of_dp_sgd_step_zero_noise():
    """Regression: with one explicit seed, DP-SNIP drew the same standard normals as DP-SGD step 0."""
    x, y = _data()
    snip, sgd = _Recorder(), _Recorder()
    with mock.patch.object(ssgd_module, "gaussian_noise", snip):
        ssgd_module.prune_dp_snip(_model(), x, y, "sparse_categorical_crossentropy", 0.5, noise_multiplier=1.0,
                                  clip_norm=1.0, sample_rate=1.0, ledger=PrivacyLedger(1e-5), seed=SEED,
                                  apply=False)
    model = _model()
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.25, seed=SEED)
    dp.set_dp_variables([model.layers[1].kernel, model.get_layer("head").kernel])  # the pruned kernels
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               run_eagerly=True)
    with mock.patch.object(dp_model_module, "gaussian_noise", sgd):
        dp.fit(x, y, epochs=1, steps_per_epoch=1, verbose=0)
    snip_noise, step_zero_noise = np.concatenate(snip.draws[0]), np.concatenate(sgd.draws[0])
    assert snip_noise.shape == step_zero_noise.shape == (6 * 8 + 8 * 3,)
    assert not np.any(snip_noise == step_zero_noise)
    # Independent standard normals: the sample correlation of 72 pairs has std ~ 1/sqrt(72) = 0.12.
    assert abs(np.corrcoef(snip_noise, step_zero_noise)[0, 1]) < 0.45


def test_streams_of_one_seed_are_uncorrelated_and_steps_differ():
    draws = {name: gaussian_noise([tf.TensorShape([4000])], 1.0, SEED, 0, stream=name)[0].numpy()
             for name in ("dp_sgd_noise", "dp_snip_noise", "frost_noise")}
    names = sorted(draws)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert abs(np.corrcoef(draws[a], draws[b])[0, 1]) < 0.06  # 4 sigma of 1/sqrt(4000)
    step_one = gaussian_noise([tf.TensorShape([4000])], 1.0, SEED, 1)[0].numpy()
    assert abs(np.corrcoef(draws["dp_sgd_noise"], step_one)[0, 1]) < 0.06


def test_frost_samples_are_not_the_training_batches():
    training = PoissonSampler(1000, 0.05, seed=SEED)
    frost = PoissonSampler(1000, 0.05, seed=SEED, stream="frost_sampling")
    overlap = [np.sum(training.sample_mask(t).numpy() & frost.sample_mask(t).numpy()) for t in range(5)]
    assert max(overlap) < 15  # independent draws share ~ 0.05 * 0.05 * 1000 = 2.5 examples
    with pytest.raises(ValueError, match="unknown random stream"):
        PoissonSampler(10, 0.5, seed=1, stream="sampling")


def test_numpy_streams_are_reproducible_and_distinct():
    a = random_streams.numpy_rng(SEED, "random_mask").random(5)
    np.testing.assert_array_equal(a, random_streams.numpy_rng(SEED, "random_mask").random(5))
    assert not np.allclose(a, random_streams.numpy_rng(SEED, "random_pruning").random(5))
    with pytest.raises(ValueError, match="seed must be in"):
        random_streams.numpy_rng(-1, "random_mask")
