"""Named random streams: one seed, one stream per mechanism, no two mechanisms share noise."""

import glob
import os
import re
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf.dp_step.noise as dp_step_noise_module
import sparta_tf.ssgd.pruning as pruning_module
from sparta_tf import DPModel, random_streams
from sparta_tf.dp_step.noise import gaussian_noise
from sparta_tf.privacy.ledger import PrivacyLedger
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.privacy.sampling import PoissonSampler
from small_models import gaussian_data

SEED = 1234


def _model():
    tf.keras.utils.set_random_seed(0)
    inputs = tf.keras.Input((6,))
    hidden = tf.keras.layers.Dense(8, activation="relu")(inputs)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(3, name="head")(hidden))


def _wide_model():
    """Two maskable kernels with enough rows (32, 32) that two random halves practically never coincide."""
    tf.keras.utils.set_random_seed(0)
    inputs = tf.keras.Input((16,))
    hidden = tf.keras.layers.Dense(32, activation="relu")(inputs)
    hidden = tf.keras.layers.Dense(32, activation="relu")(hidden)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(3, name="head")(hidden))


class _Recorder:
    """Wraps ``gaussian_noise`` and keeps every tensor it drew."""

    def __init__(self):
        self.draws = []

    def __call__(self, *args, **kwargs):
        noise = gaussian_noise(*args, **kwargs)
        self.draws.append([np.asarray(z).ravel() for z in noise])
        return noise

    def draws_one_by_one(self, *args, **kwargs):
        """Stands in for ``noise_draws`` (the DP-SGD step's noise, drawn one tensor at a time)."""
        noise = self(*args, **kwargs)
        return [lambda z=z: z for z in noise]


def test_every_stream_has_its_own_domain_and_unknown_names_fail():
    domains = [stream.domain for stream in random_streams.STREAMS.values()]
    assert len(set(domains)) == len(domains) and all(0 < d < 2**32 for d in domains)
    assert set(random_streams.SECRET_STREAMS) <= set(random_streams.STREAMS)
    assert {"dp_sgd_noise", "selection_noise", "dp_snip_noise", "frost_noise", "poisson_sampling"} <= set(
        random_streams.SECRET_STREAMS)
    with pytest.raises(ValueError, match="unknown random stream 'noize'"):
        random_streams.step_key(SEED, "noize", 0)
    keys = {tuple(random_streams.step_key(SEED, name, 0).numpy()) for name in random_streams.STREAMS}
    assert len(keys) == len(random_streams.STREAMS)


def test_dp_snip_noise_is_independent_of_dp_sgd_step_zero_noise():
    """Regression: with one explicit seed, DP-SNIP drew the same standard normals as DP-SGD step 0."""
    x, y = gaussian_data(32, (6,), 3)
    snip, sgd = _Recorder(), _Recorder()
    with mock.patch.object(pruning_module, "gaussian_noise", snip):
        pruning_module.prune_dp_snip(_model(), x, y, "sparse_categorical_crossentropy", 0.5, noise_multiplier=1.0,
                                  clip_norm=1.0, sample_rate=1.0, ledger=PrivacyLedger(1e-5), seed=SEED,
                                  apply=False)
    model = _model()
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.25, seed=SEED)
    dp.set_dp_variables([model.layers[1].kernel, model.get_layer("head").kernel])  # the pruned kernels
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               run_eagerly=True)
    with mock.patch.object(dp_step_noise_module, "noise_draws", sgd.draws_one_by_one):
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


def test_every_numpy_stream_of_one_seed_is_its_own_and_uncorrelated():
    draws = {name: random_streams.numpy_rng(SEED, name).random(4000) for name in random_streams.STREAMS}
    names = sorted(draws)
    for i, a in enumerate(names):
        np.testing.assert_array_equal(draws[a], random_streams.numpy_rng(SEED, a).random(4000))
        for b in names[i + 1:]:
            assert abs(np.corrcoef(draws[a], draws[b])[0, 1]) < 0.07, (a, b)  # 4.4 sigma of 1/sqrt(4000)
    assert not np.allclose(draws["val_split"], random_streams.numpy_rng(SEED + 1, "val_split").random(4000))


def test_the_data_and_canary_streams_draw_what_they_drew_before_the_registry():
    """Seeded data splits and audits are those of earlier versions (the constants moved, the draws did not)."""
    np.testing.assert_array_equal(random_streams.numpy_rng(7, "val_split").random(3),
                                  np.random.default_rng([7, 0x5EED_0005]).random(3))
    np.testing.assert_array_equal(random_streams.numpy_rng(7, "canaries").random(3),
                                  np.random.default_rng([7, 0xCA_4A21]).random(3))


def test_the_selection_scores_noise_has_its_own_stream():
    """Regression: the selection epoch drew DP-SGD's stream under ``seed XOR constant``, outside the registry.
    Its released noise is now the ``selection_noise`` stream's, independent of DP-SGD's noise at that step."""
    from sparta_tf.groups import row_groups
    from sparta_tf.selection.scoring import SelectionScorer

    scorer = SelectionScorer(row_groups(_wide_model()), DpSgdMechanism(1.0, 1.0, clip_norm=1.0), score="sum_abs",
                             granularity="entry")
    shapes = [tf.TensorShape(t.shape) for t in scorer.totals]
    scorer.release([tf.zeros(shape) for shape in shapes], tf.constant(SEED, tf.int64), tf.constant(3, tf.int64))
    released = np.concatenate([t.numpy().ravel() for t in scorer.totals])
    expected = gaussian_noise(shapes, 1.0, SEED, 3, stream="selection_noise")
    np.testing.assert_allclose(released, np.concatenate([z.numpy().ravel() for z in expected]), rtol=1e-6)
    training = np.concatenate([z.numpy().ravel() for z in gaussian_noise(shapes, 1.0, SEED, 3)])
    assert abs(np.corrcoef(released, training)[0, 1]) < 4 / np.sqrt(released.size)


def _mask_rows(secret_seed, public_seed, **options):
    from sparta_tf.methods import make_method

    method = make_method("random", density=0.5, verbose=0, **options)
    method.start(SimpleNamespace(model=_wide_model(), seed=secret_seed, public_seed=public_seed), epochs=1)
    return [s.rows.tolist() for s in method.mask_selections]


def test_the_random_methods_mask_follows_the_public_seed_unless_overridden():
    """``random`` draws its mask from the public seed's ``random_mask`` stream: reproducible for one seed,
    another mask for another seed, the same whatever the secret seed; ``seed`` (an explicit override) fixes
    it across runs."""
    assert _mask_rows(1, 7) == _mask_rows(2, 7)
    assert _mask_rows(1, 7) != _mask_rows(1, 8)
    assert _mask_rows(1, 7, seed=5) == _mask_rows(1, 8, seed=5) != _mask_rows(1, 7)


def test_a_run_without_a_seed_draws_its_public_seed_apart_from_the_secret_one():
    """A random mask or pruning can be read off the release, so it tests a guessed seed. Without a given seed
    the public streams' seed is a second draw from the OS, never the secret run seed; a given seed is both
    (one number reproduces the run), and ``public_seed`` overrides it."""
    with mock.patch.object(random_streams.secrets, "randbits", side_effect=[111, 222]) as draw:
        dp = DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25)
    assert draw.call_count == 2 and {dp.public_seed, dp.seed} == {111, 222}
    seeded = DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25, seed=SEED)
    assert seeded.public_seed == seeded.seed == SEED
    chosen = DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25, seed=SEED, public_seed=9)
    assert (chosen.seed, chosen.public_seed) == (SEED, 9)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25, public_seed=-1)


def test_dp_ssgds_pruning_and_dropping_follow_the_public_seed():
    from sparta_tf.methods import make_method
    from sparta_tf.ssgd import SSGDModel

    def pruned(secret_seed, public_seed):
        method = make_method("dp_ssgd", prune="random", prune_rate=0.5, verbose=0)
        model = _wide_model()
        keep = method._prune(SimpleNamespace(model=model, seed=secret_seed, public_seed=public_seed), None, None,
                             None)
        return [mask.tolist() for _, mask in keep]

    assert pruned(1, 7) == pruned(2, 7) != pruned(1, 8)
    dp = SSGDModel(_model(), noise_multiplier=1.0, sample_rate=0.25, seed=SEED, public_seed=9, drop_rate=0.5)
    assert dp.dropping.seed == 9


def test_a_checkpoint_restores_the_public_seed_and_an_older_one_without_it_still_restores(tmp_path):
    from sparta_tf import checkpointing

    first = DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25)
    tf.train.Checkpoint(**first.checkpoint_state()).write(str(tmp_path / "new" / "ckpt"))
    restored = DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25)
    checkpointing.restore(str(tmp_path / "new"), restored)
    assert (restored.seed, restored.public_seed) == (first.seed, first.public_seed)
    older = {k: v for k, v in first.checkpoint_state().items() if k != "public_seed"}
    tf.train.Checkpoint(**older).write(str(tmp_path / "old" / "ckpt"))
    built = DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25, public_seed=first.seed)
    checkpointing.restore(str(tmp_path / "old"), built)  # what private_model builds for a run state without it
    assert built.seed == built.public_seed == first.seed


SOURCES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sparta_tf")
# What builds a generator or a seed of its own: a domain constant, NumPy's generators or legacy global state,
# TensorFlow's stateful random ops and generators, Python's random module, ad-hoc seed arithmetic.
OWN_RANDOMNESS = re.compile(
    r"_DOMAINS?\b\s*(:[^=]*)?=\s*[0-9{]|\bDOMAINS\b|0x5EED|default_rng\(|np\.random\.(?!Generator\b)[A-Za-z_]+\(|"
    r"np\.random\.Generator\(|tf\.random\.(Generator|normal|uniform|shuffle|truncated_normal|categorical)\b|"
    r"^\s*(import random|from random import)|seed\s*[+^]\s*\d|bitwise_xor\(.*seed")
ALLOWED = {"random_streams.py"}  # the registry itself


def test_no_module_draws_randomness_outside_the_registry():
    """Every random choice goes through sparta_tf.random_streams: no other module defines a domain or builds a
    generator (model_checks' ``tf.random.set_seed`` is a probe's fixed global seed, restored after)."""
    offenders = []
    for path in glob.glob(os.path.join(SOURCES, "**", "*.py"), recursive=True):
        if os.path.basename(path) in ALLOWED:
            continue
        for number, line in enumerate(open(path, encoding="utf-8"), 1):
            code = line.split("#")[0]
            if OWN_RANDOMNESS.search(code) and not code.lstrip().startswith(('"', "'", "``")):
                offenders.append(f"{os.path.relpath(path, SOURCES)}:{number}: {line.strip()}")
    assert offenders == []


def test_every_stream_a_module_names_is_registered():
    """A stream name in a ``numpy_rng`` / ``step_key`` / ``int_seeds`` call, a data split's purpose or a
    ``*_STREAM`` constant is a key of STREAMS: a typo fails here, not at the first draw of a long run."""
    named = set()
    for path in glob.glob(os.path.join(SOURCES, "**", "*.py"), recursive=True):
        text = open(path, encoding="utf-8").read()
        named |= set(re.findall(r"(?:numpy_rng|step_key|int_seeds)\([^)\n]*?,\s*\"(\w+)\"", text))
        named |= set(re.findall(r"splitter\.(?:carve|limit)\([^)\n]*?,\s*\"(\w+)\"", text))  # the data splits' purposes
        named |= set(re.findall(r"\b[A-Z_]*STREAM\s*=\s*\"(\w+)\"", text))
        named |= set(re.findall(r"stream=\"(\w+)\"", text))
    assert {"random_mask", "val_split", "canaries", "augmentation", "selection_noise"} <= named
    assert named <= set(random_streams.STREAMS), named - set(random_streams.STREAMS)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_the_noise_is_philox_whatever_alg_name_draws_it(dtype):
    """``random_streams.TF_ALGORITHM`` (``auto_select``, whose key scrambling runs inside the op) draws
    exactly what ``alg="philox"`` draws on this device: the keys, the noise and the sampling's uniforms."""
    for seed, step in [(0, 0), (12345, 7), (2**62 + 3, 2**40)]:
        base = tf.constant([seed, random_streams.domain("dp_sgd_noise")], tf.int64)
        philox_key = tf.random.experimental.stateless_fold_in(base, tf.constant(step, tf.int64), alg="philox")
        key = random_streams.step_key(seed, "dp_sgd_noise", step)
        np.testing.assert_array_equal(key.numpy(), philox_key.numpy())
        sub_key = tf.random.experimental.stateless_fold_in(philox_key, 3, alg="philox")
        expected = tf.random.stateless_normal([5, 7], seed=sub_key, stddev=tf.cast(0.5, dtype), dtype=dtype,
                                              alg="philox")
        drawn = gaussian_noise([tf.TensorShape([1]), tf.TensorShape([2]), tf.TensorShape([3]),
                                tf.TensorShape([5, 7])], 0.5, tf.constant(seed, tf.int64), step, dtype=dtype)[3]
        np.testing.assert_array_equal(drawn.numpy(), expected.numpy())
        uniform = tf.random.stateless_uniform([9], seed=key, dtype=dtype, alg=random_streams.TF_ALGORITHM)
        np.testing.assert_array_equal(uniform.numpy(),
                                      tf.random.stateless_uniform([9], seed=philox_key, dtype=dtype,
                                                                  alg="philox").numpy())
