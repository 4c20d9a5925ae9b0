"""The sampling layout of a run with bands (issue 62): a selection epoch samples every example at ``q``
with independent noise and is charged as plain DP-SGD; the gradient phases stay cyclic and charged by the
reduction.

* the plan's epsilon is dp-accounting's composition of ``ceil(T_p / b)`` runs of ``M_{b q, sigma}`` per
  gradient phase and ``T_sel`` runs of ``M_{q, sigma}`` (RDP exactly, PLD within its discretisation), and
  its noise is lower than charging the selection epoch cyclically;
* the sampler reads the layout: in its plain steps every example is eligible, at rate ``q``; elsewhere
  only the step's group;
* the ledger's charge reads the same layout, step by step (a charge spanning both kinds splits), also
  the crash-safe one written before each step, and a killed run's lost steps are charged both ways;
* ``make_private`` anchors the layout at the run's first step, also for a run restarted before its
  first checkpoint (which starts at the steps the killed run ran);
* a gradient step in a plain range is refused before it runs; a dataset sampled with another layout
  is a caveat.
"""

from __future__ import annotations

import json
import math
import os
import warnings

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

import sparta_tf
from sparta_tf import DPModel
from sparta_tf.dp_model import fit_inputs
from sparta_tf.dp_model.fit_inputs import NotPoissonSampledWarning
from sparta_tf.method_spec import Phase
from sparta_tf.methods import make_method
from sparta_tf.privacy import charging
from sparta_tf.privacy.layout import SamplingLayout
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.privacy.plan import make_privacy_plan
from sparta_tf.privacy.sampling import PoissonSampler, poisson_provenance
from small_models import LOSS, small_data, small_mlp

DELTA = 1e-5
N, BATCH = 64, 16  # q = 1/4: 4 steps an epoch


def _direct(accountant, sigma: float, runs) -> float:
    for rate, count in runs:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("bands, n, batch, sigma", [(2, 1000, 50, 1.1), (4, 2000, 40, 0.9)])
def test_the_plans_epsilon_charges_the_selection_epoch_as_plain_dp_sgd(bands, n, batch, sigma):
    q = batch / n
    per_epoch = round(1 / q)
    phases = make_method("sparta", warmup_epochs=2).phases(6)  # warm-up 2, selection 1, sparse 3
    runs = [(bands * q, math.ceil(2 * per_epoch / bands)), (q, per_epoch), (bands * q, math.ceil(3 * per_epoch / bands))]
    for accountant, reference, tolerance in (("rdp", rdp_privacy_accountant.RdpAccountant(), 1e-9),
                                             ("pld", pld_privacy_accountant.PLDAccountant(), 0.02)):
        plan = make_privacy_plan(n=n, expected_batch_size=batch, phases=phases, delta=DELTA, target_epsilon=None,
                                 noise_multiplier=sigma, accountant=accountant, bands=bands)
        assert plan.epsilon == pytest.approx(_direct(reference, sigma, runs), rel=tolerance)
        selection = [e for e in plan.events() if e.phase == "selection"]
        assert [(e.sample_rate, e.count, e.bands) for e in selection] == [(q, per_epoch, 1)]


def test_sampling_the_selection_epoch_plainly_needs_less_noise_for_the_same_target():
    q, per_epoch, bands = 0.05, 20, 8
    plan = make_privacy_plan(n=5000, expected_batch_size=250, phases=make_method("sparta").phases(10), delta=DELTA,
                             target_epsilon=4.0, bands=bands)
    cyclic_selection = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(bands * q, dp_accounting.GaussianDpEvent(plan.noise_multiplier)),
            math.ceil(per_epoch * p.epochs / bands)) for p in plan.phases])
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(cyclic_selection)
    assert plan.epsilon <= 4.0 * (1 + 1e-9) < accountant.get_epsilon(DELTA)  # the old charge, at this sigma


def test_in_plain_steps_every_example_is_sampled_at_q_and_elsewhere_only_its_group():
    n, q, bands = 3000, 0.02, 4
    layout = SamplingLayout(bands, ((100, 200),))
    sampler = PoissonSampler(n, q, seed=3, bands=bands, plain_steps=layout.plain)
    groups = sampler.groups().numpy()
    cyclic = PoissonSampler(n, q, seed=3, bands=bands)
    for t in list(range(90, 100)) + list(range(200, 210)):  # cyclic steps: as without plain steps
        mask = sampler.sample_mask(t).numpy()
        assert np.array_equal(mask, cyclic.sample_mask(t).numpy()) and np.all(groups[mask] == t % bands)
    masks = np.stack([sampler.sample_mask(t).numpy() for t in range(100, 200)])
    assert abs(masks.mean() - q) < 4 * math.sqrt(q * (1 - q) / masks.size)
    for t in range(100, 200):  # each step samples from every group, about q of each
        assert len(set(groups[masks[t - 100]])) == bands
    per_group = [masks[:, groups == g].mean() for g in range(bands)]
    assert all(abs(rate - q) < 4 * math.sqrt(q * (1 - q) / (masks.shape[0] * n / bands) * 1.5) for rate in per_group)


def test_the_charge_follows_the_layout_step_by_step():
    mechanism = DpSgdMechanism(1.3, 0.1, bands=2)
    layout = SamplingLayout(2, ((10, 14),))
    entries = layout.charges(mechanism, 8, 8, "p")  # steps 8-9 cyclic, 10-13 plain, 14-15 cyclic
    assert [(e.sample_rate, e.count, e.bands) for e in entries] == [(0.2, 2, 2), (0.1, 4, 1), (0.2, 2, 2)]
    assert [e.compositions for e in entries] == [1, 4, 1]
    both = layout.charges(mechanism, None, 3, "interrupted")  # which kind each lost step was is unknown
    assert [(e.sample_rate, e.count, e.bands) for e in both] == [(0.2, 3, 2), (0.1, 3, 1)]
    assert SamplingLayout(2).charges(mechanism, None, 3) == [mechanism.entry(3)]
    assert SamplingLayout(1, ((0, 5),)).plain == ()  # one band: every step is plain already


def test_a_layout_refuses_short_or_overlapping_plain_ranges_and_gradient_steps_inside_them():
    with pytest.raises(ValueError, match="at least 4 steps"):
        SamplingLayout(4, ((0, 3),))
    with pytest.raises(ValueError, match="overlap"):
        SamplingLayout(2, ((0, 4), (3, 8)))
    layout = SamplingLayout(2, ((4, 8),))
    layout.check_gradient_steps(0, 4)
    layout.check_gradient_steps(8, 10)
    with pytest.raises(ValueError, match="plainly sampled steps"):
        layout.check_gradient_steps(3, 2)


def _sparta(bands=2, **options):
    """A sparta run of 4 epochs of 4 steps (warm-up, selection, 2 sparse) whose budget leaves room for
    the charges of a killed run."""
    return sparta_tf.make_private(small_mlp(), method="sparta", target_epsilon=50.0, noise_multiplier=1.0, delta=DELTA,
                                  epochs=4, batch_size=BATCH, dataset_size=N, seed=0, bands=bands, warmup_epochs=1,
                                  density=0.5, **options)


def test_make_private_samples_its_selection_epoch_plainly_and_its_ledger_is_its_plan():
    dp = _sparta()
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    seen = []

    class Record(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append((int(dp.dp_step.numpy()), dp.releases_gradient))

    x, y = small_data(N)
    dp.fit(x, y, verbose=0, callbacks=[Record()])
    assert dp.sampling_layout == SamplingLayout(2, ((4, 8),)) == dp.plan.sampling_layout()
    batches, _ = fit_inputs.input_pipeline(dp, x, y, 0)  # what fit fed: the sampler of the same layout
    assert poisson_provenance(batches)[:4] == (N, BATCH / N, dp.sampling_layout, 0)
    assert poisson_provenance(batches).seed == dp.seed and poisson_provenance(batches).examples == dp.cyclic_examples
    assert [step for step, gradient in seen if not gradient] == [4, 5, 6, 7]  # the selection epoch, exactly
    assert list(dp.ledger.entries) == dp.plan.events()


def test_a_run_restarted_before_its_first_checkpoint_anchors_its_layout_at_its_first_step(tmp_path):
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "checkpoints")
    (run_dir / "checkpoints" / "journal.json").write_text(json.dumps({"started_through": 3}))  # a killed run's 3 steps
    dp = _sparta(run_dir=str(run_dir))
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    dp.fit(*small_data(N), verbose=0)
    assert dp.sampling_layout.plain == ((3 + 4, 3 + 8),)
    interrupted = [e for e in dp.ledger.entries if e.phase == "interrupted"]
    assert [(e.sample_rate, e.count, e.bands) for e in interrupted] == [(0.5, 3, 2), (0.25, 3, 1)]
    assert list(dp.ledger.entries) == interrupted + dp.plan.events()


def test_a_gradient_step_in_plain_steps_is_refused_before_it_runs():
    dp = DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=BATCH / N, dataset_size=N, delta=DELTA, seed=0, bands=2)
    dp.set_sampling_layout(SamplingLayout(2, ((0, 4),)))
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    before = [v.numpy().copy() for v in dp.model.trainable_variables]
    with pytest.raises(ValueError, match="plainly sampled steps"):
        dp.fit(*small_data(N), epochs=1, verbose=0)
    assert int(dp.dp_step.numpy()) == 0
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, dp.model.trainable_variables))
    with pytest.raises(ValueError, match="bands=3"):
        dp.set_sampling_layout(SamplingLayout(3))


class _Wrapping:
    """A method's own release (``set_release``) that wraps DP-SGD's instead of subclassing it."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Opaque(_Wrapping):
    """The same, showing only the release protocol (not the noise it adds)."""

    def __getattr__(self, name):
        if name == "noise":
            raise AttributeError(name)
        return super().__getattr__(name)


@pytest.mark.parametrize("wrapper, error, message", [(_Wrapping, ValueError, "plainly sampled steps"),
                                                     (_Opaque, tf.errors.InvalidArgumentError, "samples plainly")])
def test_a_wrapped_gradient_release_in_plain_steps_is_refused_not_charged_as_plain_steps(wrapper, error, message):
    """The reviewer's case: with plain steps [0, 8) a release wrapping DP-SGD's ran its correlated noise through
    step 7 while the ledger charged 8 plain runs at q. The plain-steps guard sees the run's noise in it; where it
    cannot, the noise itself refuses the step."""
    dp = DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=BATCH / N, dataset_size=N, delta=DELTA, seed=0, bands=2)
    dp.set_sampling_layout(SamplingLayout(2, ((0, 8),)))
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS, jit_compile=False)
    dp.set_release(wrapper(dp._gradient_release()))
    before = [v.numpy().copy() for v in dp.model.trainable_variables]
    with pytest.raises(error, match=message):
        dp.fit(*small_data(N), epochs=2, verbose=0)
    assert int(dp.dp_step.numpy()) == 0 and not dp.ledger.entries
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, dp.model.trainable_variables))
    assert all((steps.numpy() == -2).all() for steps in dp.correlated_noise.steps.values())  # no noise kept


def test_a_dataset_sampled_without_the_runs_plain_steps_is_refused():
    dp = DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=BATCH / N, dataset_size=N, delta=DELTA, seed=0, bands=2)
    dp.set_sampling_layout(SamplingLayout(2, ((4, 8),)))
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    x, y = small_data(N)
    cyclic_only = PoissonSampler(N, BATCH / N, 8, seed=0, bands=2).dataset(x, y)
    with pytest.raises(ValueError, match=r"plain_steps=\[\(4, 8\)\].*other batches are refused"):
        dp.fit(cyclic_only, epochs=1, steps_per_epoch=4, verbose=0)
    assert not dp.ledger.entries and int(dp.dp_step.numpy()) == 0
    same = DPModel(small_mlp(), noise_multiplier=1.0, sample_rate=BATCH / N, dataset_size=N, delta=DELTA, seed=0, bands=2)
    same.set_sampling_layout(SamplingLayout(2, ((4, 8),)))
    same.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotPoissonSampledWarning)
        same.fit(PoissonSampler(N, BATCH / N, 8, seed=0, bands=2, plain_steps=((4, 8),)).dataset(x, y), epochs=1,
                 steps_per_epoch=4, verbose=0)
    assert not same.ledger.caveats()


def test_charging_a_killed_runs_steps_reads_the_models_layout(tmp_path):
    os.makedirs(tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "journal.json").write_text(json.dumps({"started_through": 9}))
    mechanism = DpSgdMechanism(1.0, 0.25, bands=2)
    ledger = sparta_tf.PrivacyLedger(DELTA)
    lost = charging.charge_interrupted_steps(str(tmp_path), 4, ledger, mechanism, tf.distribute.get_strategy(),
                                             SamplingLayout(2, ((4, 8),)))
    assert lost == 5
    assert [(e.sample_rate, e.count, e.bands) for e in ledger.entries] == [(0.5, 5, 2), (0.25, 5, 1)]


def test_the_journal_charges_a_selection_step_plainly_before_it_runs(tmp_path):
    """The crash-safe charge (``ledger.json`` rewritten before each step) reads the same layout."""
    dp = _sparta(run_dir=str(tmp_path))
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=LOSS)
    written = {}

    class ReadLedger(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            with open(tmp_path / "ledger.json") as f:
                written[int(dp.dp_step.numpy()) - 1] = json.load(f)["entries"]

    dp.fit(*small_data(N), verbose=0, callbacks=[ReadLedger()])
    during_selection = [(e["phase"], e["sample_rate"], e["count"], e.get("bands", 1)) for e in written[5]]
    assert during_selection == [("warmup", 0.5, 4, 2), ("selection", 0.25, 2, 1)]  # steps 4 and 5: plain
    after = [(e["phase"], e["sample_rate"], e["count"], e.get("bands", 1)) for e in written[8]]
    assert after[-1] == ("sparse", 0.5, 1, 2)
