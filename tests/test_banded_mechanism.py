"""BandMF in the DP step (issue 62): the ledger's reduction against dp-accounting, cyclic Poisson
groups, the correlated noise's covariance, ``bands=1`` unchanged, frozen coordinates, resume, refusals.

* the plan's epsilon is dp-accounting's composition of ``ceil(T_p / b)`` runs of
  ``PoissonSampled(b q, Gaussian(sigma))`` per phase (RDP exactly, PLD within the discretisation), for several ``(b, q, T, sigma)``;
* every sampled example belongs to the group of its step (``t mod b``), each is sampled at rate ``q``
  per step, and ``bands=1`` samples bit-identically to the sampler without bands;
* with zero gradients the injected noise over ``T`` steps has covariance ``sigma^2 C_clip^2 C^{-1} C^{-T}``
  (statistical tolerance), and ``w = C^{-1} z`` exactly for the stream's ``z``;
* each kind of method trains with bands through ``make_private`` and charges its plan;
* a DP model with bands trains only its trainable coordinates, charges banded entries, and a model
  restored from a mid-run checkpoint continues bit-identically (the noise buffer is in the checkpoint);
* what the analysis does not cover is refused in one line before anything is charged.
"""

from __future__ import annotations

import json
import math
import os
import re

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

import sparta_tf
from sparta_tf import DPModel
from sparta_tf.dp_step.correlated_noise import CorrelatedNoise, noise_buffer_bytes
from sparta_tf.dp_step.noise import gaussian_noise
from sparta_tf.method_spec import Phase
from sparta_tf.privacy.banded import BandedFactorization
from sparta_tf.privacy.array_inputs import examples_fingerprint
from sparta_tf.privacy.banded_error import compare_bands, describe_comparison
from sparta_tf.privacy.layout import SamplingLayout
from sparta_tf.privacy.ledger import LedgerEntry
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.privacy.plan import banded_compositions, make_privacy_plan
from sparta_tf.privacy.sampling import PoissonSampler
from sparta_tf.trainable import TrainableSet
from small_configs import tiny_config
from small_models import LOSS, small_data, small_mlp
from two_replicas import two_cpu_replicas
from trainers import run
from trainers.config import validate

DELTA = 1e-5


def _direct(accountant, sigma: float, rate: float, runs_per_phase) -> float:
    event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma))
    for runs in runs_per_phase:
        accountant.compose(event, runs)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("bands, n, batch, epochs, sigma", [(2, 1000, 50, (2, 1), 1.1), (4, 600, 40, (3,), 0.9),
                                                            (8, 4000, 100, (1, 2), 1.6)])
def test_the_plans_epsilon_is_the_reduction_composed_in_dp_accounting(bands, n, batch, epochs, sigma):
    phases = [Phase(f"p{i}", epochs=e) for i, e in enumerate(epochs)]
    q = batch / n
    per_epoch = round(1 / q)
    runs = [math.ceil(e * per_epoch / bands) for e in epochs]
    for accountant in ("rdp", "pld"):
        plan = make_privacy_plan(n=n, expected_batch_size=batch, phases=phases, delta=DELTA, target_epsilon=None,
                                 accountant=accountant, noise_multiplier=sigma, bands=bands)
        assert plan.group_sample_rate == pytest.approx(bands * q)
        assert [e.compositions for e in plan.events()] == runs
        if accountant == "rdp":
            direct = _direct(rdp_privacy_accountant.RdpAccountant(), sigma, bands * q, runs)
            assert plan.epsilon == pytest.approx(direct, rel=1e-12)
        else:
            direct = _direct(pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4), sigma,
                             bands * q, runs)
            assert direct * (1 - 1e-9) <= plan.epsilon <= direct * (1 + 2e-3)


def test_a_calibrated_banded_plan_meets_its_target_and_one_band_is_todays_plan():
    phases = [Phase("train", epochs=4)]
    today = make_privacy_plan(n=2000, expected_batch_size=100, phases=phases, delta=DELTA, target_epsilon=4.0)
    one = make_privacy_plan(n=2000, expected_batch_size=100, phases=phases, delta=DELTA, target_epsilon=4.0, bands=1)
    assert one == today and [e.to_dict() for e in one.events()] == [e.to_dict() for e in today.events()]
    assert "bands" not in today.events()[0].to_dict()  # the ledger format of independent noise is unchanged
    banded = make_privacy_plan(n=2000, expected_batch_size=100, phases=phases, delta=DELTA, target_epsilon=4.0,
                               bands=4)
    assert banded.epsilon <= 4.0 * (1 + 1e-9) and banded.epsilon > 3.9
    assert banded.noise_multiplier != today.noise_multiplier
    assert "correlated noise: 4 bands" in banded.describe()


def test_a_merged_banded_entry_charges_ceil_of_its_steps_over_b():
    entry = LedgerEntry(1.0, 0.2, 9, bands=4)
    assert entry.compositions == 3 and entry.as_dp_event() == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(1.0)), 3)
    assert LedgerEntry.from_dict(entry.to_dict()) == entry
    mechanism = DpSgdMechanism(1.0, 0.05, bands=4)
    assert mechanism.entry(9) == entry and mechanism.step_sample_rate == pytest.approx(0.2)


@pytest.mark.parametrize("bands", [1, 3])
def test_every_sampled_example_is_in_its_steps_group_at_rate_q(bands):
    n, q, steps = 3000, 0.02, 240
    sampler = PoissonSampler(n, q, seed=11, bands=bands)
    groups = sampler.groups().numpy()
    masks = np.stack([sampler.sample_mask(t).numpy() for t in range(steps)])
    for t in range(steps):
        assert np.all(groups[masks[t]] == t % bands)
    rate = masks.mean()  # per example and step: q (binomial std over n * steps draws)
    assert abs(rate - q) < 4 * math.sqrt(q * (1 - q) / (n * steps))
    if bands > 1:
        counts = np.bincount(groups, minlength=bands)
        assert np.all(np.abs(counts - n / bands) < 4 * math.sqrt(n / bands))
    else:
        plain = PoissonSampler(n, q, seed=11)
        assert all(np.array_equal(plain.sample_mask(t).numpy(), masks[t]) for t in range(steps))


def _fake_set(shape):
    variable = tf.Variable(tf.zeros(shape), name="w")
    return TrainableSet.of_variables([variable])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_correlated_noise_is_c_inverse_of_the_streams_draws_and_has_its_covariance(jit_compile):
    """Eagerly and compiled by XLA (whose draws of the same stream are other numbers than TensorFlow's
    kernels': each is checked against the draws of its own kind)."""
    bands, steps, coordinates, sigma = 3, 6, 20000, 1.5
    mechanism = DpSgdMechanism(sigma, 0.05, clip_norm=2.0, bands=bands)
    seed = tf.constant(5, tf.int64)
    noise = CorrelatedNoise(mechanism, seed)
    noise.build(_fake_set([coordinates]))
    zeros = [tf.zeros([coordinates])]
    compiled = (lambda f: tf.function(f, jit_compile=True)) if jit_compile else (lambda f: f)
    correlated = compiled(lambda t: noise(zeros, t)[0])
    independent = compiled(lambda t: gaussian_noise([tf.TensorShape([coordinates])], mechanism.noise_std, seed, t)[0])
    w = np.stack([correlated(tf.constant(t, tf.int64)).numpy() for t in range(steps)])
    z = np.stack([independent(tf.constant(t, tf.int64)).numpy() for t in range(steps)])
    factorization = BandedFactorization(bands)
    np.testing.assert_allclose(w, factorization.correlate(z), rtol=1e-4, atol=1e-4)
    inverse = np.linalg.inv(factorization.matrix(steps))
    expected = (sigma * 2.0) ** 2 * inverse @ inverse.T
    empirical = w @ w.T / coordinates
    assert np.abs(empirical - expected).max() < 5 * (sigma * 2.0) ** 2 * np.abs(expected).max() / math.sqrt(
        coordinates) * 3


def test_one_band_adds_exactly_the_independent_noise():
    mechanism = DpSgdMechanism(1.2, 0.05)
    seed = tf.constant(9, tf.int64)
    noise = CorrelatedNoise(mechanism, seed)
    noise.build(_fake_set([7, 3]))
    sums = [tf.ones([7, 3])]
    for t in range(3):
        step = tf.constant(t, tf.int64)
        expected = sums[0] + gaussian_noise([tf.TensorShape([7, 3])], mechanism.noise_std, seed, step)[0]
        assert np.array_equal(noise(sums, step)[0].numpy(), expected.numpy())


@pytest.mark.parametrize("jit_compile", [False, True])
def test_correlated_noise_refuses_a_plainly_sampled_step_whatever_calls_it(jit_compile):
    """A step the layout samples plainly is refused before anything is added or kept; under XLA, which drops
    assertions, it adds the stream's independent draw and keeps it under no step, so the band restarts after
    the plain range (the plain DP-SGD step the ledger charges)."""
    bands, coordinates = 3, 50
    mechanism = DpSgdMechanism(1.0, 0.05, bands=bands)
    seed = tf.constant(5, tf.int64)
    noise = CorrelatedNoise(mechanism, seed, layout=lambda: SamplingLayout(bands, ((2, 5),)))
    noise.build(_fake_set([coordinates]))
    zeros = [tf.zeros([coordinates])]
    compiled = (lambda f: tf.function(f, jit_compile=True)) if jit_compile else (lambda f: f)
    correlated = compiled(lambda t: noise(zeros, t)[0])
    if not jit_compile:
        correlated(tf.constant(1, tf.int64))
        kept = [v.numpy().copy() for v in (*noise.buffers.values(), *noise.steps.values())]
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"samples plainly \(steps \[\(2, 5\)\]\)"):
            correlated(tf.constant(2, tf.int64))
        assert all(np.array_equal(a, v.numpy()) for a, v in zip(kept, (*noise.buffers.values(), *noise.steps.values())))
        return
    independent = compiled(lambda t: gaussian_noise([tf.TensorShape([coordinates])], mechanism.noise_std, seed, t)[0])
    w = np.stack([correlated(tf.constant(t, tf.int64)).numpy() for t in range(8)])
    z = np.stack([independent(tf.constant(t, tf.int64)).numpy() for t in range(8)])
    factorization = BandedFactorization(bands)
    np.testing.assert_allclose(w[:2], factorization.correlate(z[:2]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(w[2:5], z[2:5])
    np.testing.assert_allclose(w[5:], factorization.correlate(z[5:]), rtol=1e-5, atol=1e-5)


def _data(n=96):
    rng = np.random.RandomState(0)
    x = rng.randn(n, 6).astype("float32")
    return x, (x[:, 0] > 0).astype("int64")


def _banded_model(bands=3, seed=4, frozen=False, **options):
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(5, activation="tanh", name="hidden"),
                                 tf.keras.layers.Dense(2, name="head")], name="banded_mlp")  # Keras 3's state keys hold it
    if frozen:
        model.get_layer("hidden").trainable = False
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.125, delta=1e-4, seed=seed, bands=bands, **options)
    dp.compile(tf.keras.optimizers.SGD(0.05, momentum=0.5),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return dp


def test_a_banded_fit_trains_only_trainable_coordinates_and_charges_the_reduction():
    x, y = _data()
    dp = _banded_model(frozen=True)
    frozen = [v.numpy().copy() for v in dp.model.get_layer("hidden").weights]
    dp.fit(x, y, epochs=2, verbose=0)
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(frozen, dp.model.get_layer("hidden").weights))
    (entry,) = dp.ledger.entries
    assert (entry.count, entry.bands, entry.compositions) == (16, 3, 6)
    assert entry.sample_rate == pytest.approx(0.375)
    assert dp.correlated_noise.memory_bytes == 2 * (5 * 2 + 2) * 4


def test_a_fit_on_other_examples_or_another_order_is_refused_before_a_step_and_the_same_trains_on():
    """The cyclic groups are drawn by position: reordered arrays would move examples to other groups
    than the earlier steps (and the noise they buffered) assumed."""
    x, y = _data()
    dp = _banded_model()
    dp.fit(x, y, epochs=1, verbose=0)
    charged, weights = list(dp.ledger.entries), [w.numpy() for w in dp.model.weights]
    order = np.random.RandomState(1).permutation(len(x))
    for other_x, other_y in ((x[order], y[order]), (x + 1.0, y)):
        with pytest.raises(ValueError, match="other examples .*or the same in another order.* bands=3"):
            dp.fit(other_x, other_y, epochs=1, verbose=0)
    assert list(dp.ledger.entries) == charged
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(weights, dp.model.weights))
    dp.fit(x.copy(), y.copy(), epochs=1, verbose=0)  # the same examples, in the same order
    assert int(dp.dp_step.numpy()) == 16


def test_a_banded_fit_on_a_sampler_of_another_seed_or_other_examples_is_refused_before_a_step():
    """A PoissonSampler's dataset draws its own groups (from its seed, by position): after an array fit, or
    another sampler's, they would not be the groups the model's buffered noise assumed."""
    x, y = _data()
    dp = _banded_model()
    dp.fit(x, y, epochs=1, verbose=0)
    charged, step = list(dp.ledger.entries), int(dp.dp_step.numpy())
    sampler = lambda seed: PoissonSampler(len(x), 0.125, seed=seed, bands=3)  # noqa: E731
    with pytest.raises(ValueError, match=r"drawn with another seed than this model's.* seed=dp\.seed"):
        dp.fit(sampler(None).dataset(x, y, start_step=step), epochs=1, steps_per_epoch=8, verbose=0)
    with pytest.raises(ValueError, match="other examples .*or the same in another order"):
        dp.fit(sampler(dp.seed).dataset(x[::-1], y[::-1], start_step=step), epochs=1, steps_per_epoch=8, verbose=0)
    assert list(dp.ledger.entries) == charged and int(dp.dp_step.numpy()) == step
    dp.fit(sampler(dp.seed).dataset(x, y, start_step=step), epochs=1, steps_per_epoch=8, verbose=0)
    assert int(dp.dp_step.numpy()) == 2 * step


# The same banded run by every way a step can be computed: the engines, micro-batches, K identical views
# (their mean is the example's gradient), two replicas (every replica adds the same noise once). Under XLA
# the stream's draws are other numbers: a jit-compiled step's noise is checked against XLA's own draws
# (test_correlated_noise_is_c_inverse_of_the_streams_draws_and_has_its_covariance[True]) and trains below.
STEP_VARIANTS = {
    "layerwise": dict(engine="layerwise"),
    "vectorized": dict(engine="vectorized"),
    "micro_batches": dict(physical_batch_size=5),
    "identical_views": dict(augmult=2, augmentation=lambda x, seed: x),
    "two_replicas": dict(physical_batch_size=16),
}


@pytest.mark.parametrize("variant", sorted(STEP_VARIANTS))
def test_every_engine_xla_micro_batches_views_and_replicas_add_the_same_banded_noise(variant):
    x, y = _data()
    reference = _banded_model()
    reference.fit(x, y, epochs=2, verbose=0)
    strategy = two_cpu_replicas() if variant == "two_replicas" else tf.distribute.get_strategy()
    with strategy.scope():
        other = _banded_model(**STEP_VARIANTS[variant])
    other.fit(x, y, epochs=2, verbose=0)
    assert other.ledger.entries == reference.ledger.entries
    for a, b in zip(reference.model.weights, other.model.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{variant}: {a.name}")
    independent = _banded_model(bands=1)  # the noise is what makes the runs agree, not no noise at all
    independent.fit(x, y, epochs=2, verbose=0)
    assert not np.allclose(independent.model.weights[0].numpy(), reference.model.weights[0].numpy(), atol=1e-3)


def test_a_jit_compiled_banded_fit_with_micro_batches_charges_the_reduction():
    x, y = _data()
    dp = _banded_model(jit_compile=True, physical_batch_size=5)
    before = [v.numpy().copy() for v in dp.model.trainable_variables]
    dp.fit(x, y, epochs=2, verbose=0)
    (entry,) = dp.ledger.entries
    assert (entry.count, entry.bands, entry.compositions) == (16, 3, 6)
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before, dp.model.trainable_variables))
    assert all(np.isfinite(v.numpy()).all() for v in dp.model.weights)


@pytest.mark.parametrize("bands", [1, 3])
def test_the_buffered_noise_counts_against_max_memory(bands):
    x, y = _data()
    dp = _banded_model(bands=bands, max_memory=4096)
    dp.fit(x, y, epochs=1, verbose=0)
    buffered = (bands - 1) * (6 * 5 + 5 + 5 * 2 + 2) * 4
    assert (dp.correlated_noise is None) == (bands == 1)  # independent noise buffers nothing
    assert bands == 1 or dp.correlated_noise.memory_bytes == buffered
    assert dp.engine_memory_plan().budget == 4096 - buffered


def test_a_model_restored_from_a_mid_run_checkpoint_continues_bit_identically(tmp_path):
    x, y = _data()
    straight = _banded_model()
    straight.fit(x, y, epochs=2, verbose=0)
    first = _banded_model()
    first.fit(x, y, epochs=1, verbose=0)
    tf.train.Checkpoint(**first.checkpoint_state()).write(str(tmp_path / "ckpt"))
    resumed = _banded_model(seed=None)  # the checkpoint's seed samples, and keeps the groups, not a fresh one
    tf.train.Checkpoint(**resumed.checkpoint_state()).read(str(tmp_path / "ckpt")).assert_consumed()
    resumed.ledger = first.ledger
    assert resumed.seed == first.seed
    with pytest.raises(ValueError, match=r"does not know which examples its cyclic groups were drawn for"):
        resumed.fit(x, y, epochs=1, verbose=0)
    assert int(resumed.dp_step.numpy()) == int(first.dp_step.numpy())
    resumed.cyclic_examples = first.cyclic_examples
    resumed.fit(x, y, epochs=1, verbose=0)
    for a, b in zip(straight.model.weights, resumed.model.weights):
        assert np.array_equal(a.numpy(), b.numpy())
    lost = _banded_model()  # the same restore without the buffered noise: not the same run
    state = {k: v for k, v in lost.checkpoint_state().items() if k != "correlated_noise"}
    tf.train.Checkpoint(**state).read(str(tmp_path / "ckpt")).expect_partial()
    lost.ledger = first.ledger
    lost.cyclic_examples = first.cyclic_examples
    lost.fit(x, y, epochs=1, verbose=0)
    assert not all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(straight.model.weights, lost.model.weights))


@pytest.mark.parametrize("arguments, message", [
    (dict(bands=9), r"^bands=9 needs a sampling rate of 1\.12 per group \(bands x q\), above 1: keep bands <= 8"),
    (dict(bands=2, sampling="shuffle"), r"^bands=2 needs cyclic Poisson sampling, which sampling='shuffle' is not"),
    (dict(bands=0), r"^bands=0 must be an integer >= 1"),
])
def test_what_the_analysis_does_not_cover_is_refused_in_one_line(arguments, message):
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=message):
        DPModel(model, noise_multiplier=1.0, sample_rate=0.125, delta=1e-4, **arguments)


def test_a_phase_shorter_than_the_bands_is_refused_and_make_private_plans_with_bands():
    with pytest.raises(ValueError, match=r"^bands=4 is more than the 3 steps of a phase: lower bands to at most 3"):
        banded_compositions([40, 3], 4)
    assert banded_compositions([40, 0, 9], 4) == (10, 0, 3)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(2)])
    dp = sparta_tf.make_private(model, method="all", target_epsilon=4.0, delta=1e-4, epochs=2, batch_size=10,
                                dataset_size=200, bands=4)
    assert dp.mechanism.bands == 4 and dp.plan.bands == 4 and dp.plan.events()[0].compositions == 10
    with pytest.raises(ValueError, match=r"^bands=40 needs a sampling rate of 2 per group"):
        sparta_tf.make_private(model, method="all", target_epsilon=4.0, delta=1e-4, epochs=2, batch_size=10,
                               dataset_size=200, bands=40)


N, BATCH, EPOCHS = 64, 16, 3
OPTIONS = {"sparta": {"warmup_epochs": 1}, "dpsgd_grad": {"warmup_epochs": 1}, "oracle": {"warmup_epochs": 1},
           "x_bitfit": {"full_epochs": 1}}


# Where bands meet a method differently: a selection epoch (sparta), two phases (x_bitfit), the whole model
# (all), a mechanism before training (dp_frost), a gradient filter and pre-pruning (dp_ssgd).
BANDED_METHODS = ("all", "dp_frost", "dp_ssgd", "sparta", "x_bitfit")


@pytest.mark.parametrize("method", BANDED_METHODS)
def test_each_kind_of_method_trains_with_bands_and_its_ledger_is_its_plan(method, tmp_path):
    model = small_mlp()
    before = [v.numpy().copy() for v in model.trainable_variables]
    dp = sparta_tf.make_private(model, method=method, target_epsilon=8.0, delta=1e-5, epochs=EPOCHS, batch_size=BATCH,
                                dataset_size=N, seed=0, bands=2, mask_dir=str(tmp_path / "mask"),
                                **OPTIONS.get(method, {}))
    dp.compile(tf.keras.optimizers.SGD(0.5, momentum=0.5), loss=LOSS, metrics=["accuracy"])
    x, y = small_data(N)
    history = dp.fit(x, y, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert list(dp.ledger.entries) == dp.plan.events()
    training = [e for e in dp.ledger.entries if e.kind == "dp_sgd_step"]
    releases_gradient = {p.name: p.updates for p in dp.plan.phases}
    cyclic = [e for e in training if releases_gradient[e.phase]]
    assert cyclic and all(e.bands == 2 and e.sample_rate == pytest.approx(2 * BATCH / N) for e in cyclic)
    plain = [e for e in training if not releases_gradient[e.phase]]  # sparta's selection epoch
    assert all(e.bands == 1 and e.sample_rate == pytest.approx(BATCH / N) for e in plain)
    assert bool(plain) == (method == "sparta")
    moved = [not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables)]
    assert any(moved), f"{method}: no weight trained"


def test_sparta_train_runs_with_bands_and_charges_them(tmp_path, capsys):
    config = validate(tiny_config(tmp_path / "out", method="all", epochs=2, export=True) | {"training": {
        "epochs": 2, "batch_size": 32, "learning_rate": 0.05, "seed": 0, "max_memory": "1GiB"}})
    config["privacy"]["bands"] = 2
    run.dry_run(config)
    out = capsys.readouterr().out
    coordinates = int(re.search(r"^all +2 +([\d,]+) \(100\.00%\)", out, re.M).group(1).replace(",", ""))
    buffered = noise_buffer_bytes(2, coordinates)  # one buffered draw of every coordinate
    assert f"budget {(2**30 - buffered) / 2**20:.0f} MiB (max_memory, less {buffered / 2**20:.0f} MiB of buffered " \
           "correlated noise)" in out, out
    results = run.train(config)  # sparta-train's run, in this process
    ledger = json.loads((tmp_path / "out" / "ledger.json").read_text())
    assert {entry.get("bands") for entry in ledger["entries"]} == {2} and results["epsilon"] <= 8.0 + 1e-6
    assert os.path.exists(os.path.join(results["export_dir"], "saved_model.pb"))  # the TF Serving export


def test_the_dry_run_comparison_names_the_bands_with_the_least_noise():
    phases = [Phase("train", epochs=4)]

    def plan_with_bands(bands):
        return make_privacy_plan(n=4000, expected_batch_size=200, phases=phases, delta=DELTA, target_epsilon=8.0,
                                 bands=bands)

    errors = compare_bands(plan_with_bands, momentum=0.0, candidates=(1, 2, 4, 8, 32))
    assert [e.bands for e in errors] == [1, 2, 4, 8]  # b = 32 > 1 / q is skipped
    assert errors[0].ratio == 1.0 and min(e.ratio for e in errors) < 1.0
    line = describe_comparison(errors, chosen=1)
    best = min(errors, key=lambda e: e.ratio).bands
    assert f"bands={best} minimises it; this run uses bands=1" in line


class _StopAt(tf.keras.callbacks.Callback):
    """Stops the process's fit mid-epoch, as a kill would: nothing after the last epoch's checkpoint."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_begin(self, batch, logs=None):
        if int(self.model.dp_step.numpy()) == self.step:
            raise KeyboardInterrupt


def _named_mlp() -> tf.keras.Model:
    """small_mlp's layers in a model with a fixed name: Keras 3 keys the optimizer's and the noise's state by
    the model's name, which a resumed run in a new process has again (here, in one process, it must be given)."""
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(32, activation="relu", name="d1"),
                                tf.keras.layers.Dense(32, activation="relu", name="d2"),
                                tf.keras.layers.Dense(4, name="head")], name="resumed_mlp")


def _sparta_with_bands(run_dir, stop_at=None):
    dp = sparta_tf.make_private(_named_mlp(), method="sparta", target_epsilon=50.0, noise_multiplier=1.0, delta=1e-5,
                                epochs=5, batch_size=BATCH, dataset_size=N, seed=0, bands=2, run_dir=str(run_dir),
                                warmup_epochs=2, density=0.5)
    dp.compile(tf.keras.optimizers.SGD(0.5, momentum=0.5), loss=LOSS)
    x, y = small_data(N)
    dp.fit(x, y, verbose=0, callbacks=[] if stop_at is None else [_StopAt(stop_at)])
    return [v.numpy() for v in dp.model.weights]


# 4 steps an epoch: warm-up 0-7, selection 8-11 (sampled plainly), sparse 12-19; each stop resumes from a
# checkpoint in the middle of a phase, whose buffered noise (w of the step before) the next step needs, or whose
# sampling (the selection epoch's) the resumed run must take from the same layout
@pytest.mark.parametrize("stop_at", [6, 10, 17])
def test_a_run_stopped_mid_phase_and_resumed_adds_the_noise_of_an_uninterrupted_one(tmp_path, stop_at):
    straight = _sparta_with_bands(tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        _sparta_with_bands(tmp_path / "stopped", stop_at)
    resumed = _sparta_with_bands(tmp_path / "stopped")
    assert all(np.array_equal(a, b) for a, b in zip(straight, resumed))
    checkpoints = tmp_path / "stopped" / "checkpoints"
    state = json.loads((checkpoints / (checkpoints / "latest").read_text().strip() / "state.json").read_text())
    assert state["cyclic_examples"] == examples_fingerprint(*small_data(N))  # a resume checks its examples


def test_each_process_killed_before_the_first_checkpoint_is_charged_its_own_ceiling(tmp_path):
    """Killed at step 2 (3 steps journalled), then, restarted without a checkpoint, at step 5 (3 more): with the
    default secret seed each process draws its own groups, so the third charges ceil(3 / 2) twice, not ceil(6 / 2)
    once (both ways: the selection epoch's plain steps are in the layout)."""
    for stop_at in (2, 5):
        with pytest.raises(KeyboardInterrupt):
            _sparta_with_bands(tmp_path, stop_at)
    journal = json.loads((tmp_path / "checkpoints" / "journal.json").read_text())
    assert (journal["started_through"], journal["process_starts"]) == (6, [0, 3])
    dp = sparta_tf.make_private(_named_mlp(), method="sparta", target_epsilon=50.0, noise_multiplier=1.0, delta=1e-5,
                                epochs=5, batch_size=BATCH, dataset_size=N, bands=2, run_dir=str(tmp_path),
                                warmup_epochs=2, density=0.5)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    with pytest.raises(KeyboardInterrupt):
        dp.fit(*small_data(N), verbose=0, callbacks=[_StopAt(6)])  # the charge, then no step
    interrupted = [(e.sample_rate, e.count, e.compositions) for e in dp.ledger.entries if e.phase == "interrupted"]
    assert interrupted == [(0.5, 3, 2), (0.25, 3, 3)] * 2
