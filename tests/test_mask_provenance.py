"""A loaded mask brings its privacy cost: an oracle mask makes the run non-private, a SPARTA mask's
selection epoch is charged again, a mask from another model is refused."""

import dataclasses
import json

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf as st
from sparta_tf import methods
from sparta_tf.groups import row_groups
from sparta_tf.masks import MaskProvenance, load_mask, read_provenance, save_mask
from small_models import LOSS as XENT
from small_models import gaussian_data, small_mlp


def _model(seed=0, width=6):
    tf.keras.utils.set_random_seed(seed)
    inputs = tf.keras.Input((6, 6, 1))
    x = tf.keras.layers.Conv2D(width, 3, name="conv1")(inputs)
    x = tf.keras.layers.GroupNormalization(2, name="gn1")(x)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(8, activation="relu", name="fc")(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(3, name="head")(x))


def _dp(model):
    dp = st.DPModel(model, noise_multiplier=1.0, sample_rate=0.25, delta=1e-5, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.05), loss=XENT)
    return dp


def test_an_oracle_mask_makes_the_run_that_loads_it_non_private(tmp_path):
    """Regression: the mask's `private: false` was read and dropped; the second run reported eps = 6.45."""
    x, y = gaussian_data(48, (6, 6, 1), 3)
    first = _dp(_model())
    first.fit(x, y, epochs=3, verbose=0,
              callbacks=[st.callbacks.MethodCallback("oracle", warmup_epochs=1, mask_dir=str(tmp_path), verbose=0)])
    assert not read_provenance(str(tmp_path)).private

    second = _dp(_model())
    second.fit(x, y, epochs=2, verbose=0, callbacks=[st.callbacks.SpartaCallback(warmup_epochs=1, mask=str(tmp_path),
                                                                       verbose=0)])
    assert not second.ledger.is_private
    assert second.ledger.epsilon() == float("inf")
    assert any("oracle" in reason for reason in second.ledger.nonprivate_reasons)


def test_a_sparta_mask_brings_its_selection_cost_into_the_run_that_loads_it(tmp_path):
    x, y = gaussian_data(48, (6, 6, 1), 3)
    first = _dp(_model())
    first.fit(x, y, epochs=3, verbose=0,
              callbacks=[st.callbacks.SpartaCallback(warmup_epochs=1, mask_dir=str(tmp_path), verbose=0)])
    provenance = read_provenance(str(tmp_path))
    assert provenance.private
    assert [(e.phase, e.count) for e in provenance.entries] == [("warmup", 4), ("selection", 4)]

    second = _dp(_model())
    second.fit(x, y, epochs=2, verbose=0, callbacks=[st.callbacks.SpartaCallback(warmup_epochs=1, mask=str(tmp_path),
                                                                       verbose=0)])
    phases = [(e.phase, e.count) for e in second.ledger.entries]
    assert phases == [("mask:warmup", 4), ("mask:selection", 4), ("warmup", 4), ("sparse", 4)]
    own_steps_only = st.compute_epsilon(1.0, 0.25, 8, 1e-5)
    assert second.ledger.epsilon() > own_steps_only * 1.2  # 16 steps composed, not 8


def test_a_mask_chosen_from_shuffled_batches_carries_that_caveat_into_the_run_that_loads_it(tmp_path):
    """Regression: the provenance kept the entries but not the sampling mode, so a mask chosen with
    fixed-size shuffled batches was charged into a Poisson run as if Poisson-sampled, with no warning."""
    chooser = st.PrivacyLedger(1e-5, sampling="shuffle")
    chooser.record(1.0, 0.25, 4, phase="selection")
    model = _model()
    mask = [st.trainable.rows(g, [0]) for g in row_groups(model)]
    save_mask(str(tmp_path), mask, model, provenance=MaskProvenance.of_ledger(chooser), method="sparta")
    loader = st.PrivacyLedger(1e-5)
    read_provenance(str(tmp_path)).charge(loader, str(tmp_path))
    restored = st.PrivacyLedger.from_json(json.loads(json.dumps(loader.to_json())))
    for ledger in (loader, restored):
        assert ledger.is_private and any("shuffle" in caveat for caveat in ledger.caveats())
        assert "WARNING: the mask loaded from" in ledger.report()


def test_a_loaded_masks_cost_is_charged_by_every_start_but_never_journalled_as_a_new_release(tmp_path):
    """A run that loads a mask charges the mask's cost at its start; a resume before the first
    checkpoint charges again only what draws new noise before training, or the mask would count twice."""
    from sparta_tf.privacy.plan import Mechanism

    chooser = st.PrivacyLedger(1e-5)
    chooser.record(1.0, 0.25, 4, phase="selection")
    model = _model()
    save_mask(str(tmp_path), [st.trainable.rows(g, [0]) for g in row_groups(model)], model,
              provenance=MaskProvenance.of_ledger(chooser), method="sparta")
    loaded = methods.make_method("sparta", mask=str(tmp_path)).mechanisms_before_training(48, 0.25)
    assert [(m.phase, m.count, m.draws_noise) for m in loaded] == [("mask:selection", 4, False)]
    snip = Mechanism("pre-pruning", 1.0, 1, 2.0, "dp_snip")
    plan = dataclasses.replace(_plan_stub(), before_training=tuple(loaded) + (snip,))
    assert [e.phase for e in plan.before_training_entries()] == ["mask:selection", "pre-pruning"]
    assert [e.phase for e in plan.before_training_entries(releases_only=True)] == ["pre-pruning"]


def _plan_stub():
    from sparta_tf.privacy.plan import PrivacyPlan

    return PrivacyPlan(n=48, sample_rate=0.25, steps_per_epoch=4, epochs=1, noise_multiplier=1.0, delta=1e-5,
                       target_epsilon=None, accountant="pld", before_training=(), phases=())


def test_a_public_mask_costs_nothing_and_a_mask_without_provenance_is_not_private(tmp_path):
    model = _model()
    mask = [st.trainable.rows(g, [0]) for g in row_groups(model)]
    save_mask(str(tmp_path / "public"), mask, model, provenance=MaskProvenance.public(), method="hand-made")
    assert read_provenance(str(tmp_path / "public")) == MaskProvenance.public()
    save_mask(str(tmp_path / "bare"), mask, model, provenance=MaskProvenance.public())
    npz = tmp_path / "bare" / "mask.npz"
    with np.load(npz) as data:
        arrays = dict(data)
    meta = json.loads(str(arrays["__meta__"]))
    del meta["privacy"]  # as an older sparta-tf or a hand-written file would leave it
    arrays["__meta__"] = np.array(json.dumps(meta))
    np.savez(npz, **arrays)
    provenance = read_provenance(str(tmp_path / "bare"))
    assert not provenance.private and "no privacy provenance" in provenance.reasons[0]


def test_a_mask_of_an_auto_named_model_says_to_name_the_model(tmp_path):
    """Keras 3 puts a Sequential model's name in its variables' paths and names each unnamed one anew, so a
    mask saved from one does not load into the next built in the process (a notebook re-running its cell):
    the error says to name the model; named, it loads. Keras 2's variable names hold no model name."""
    def saved_and_loaded(name):
        first = small_mlp(name)
        save_mask(str(tmp_path / str(name)), [st.trainable.rows(g, [0]) for g in row_groups(first)], first,
                  provenance=MaskProvenance.public())
        return load_mask(str(tmp_path / str(name)), small_mlp(name))

    assert len(saved_and_loaded("mlp")[0]) == 2  # d1, d2 (the head is not maskable)
    if not st.backend.KERAS3:
        assert len(saved_and_loaded(None)[0]) == 2
        return
    with pytest.raises(ValueError, match=r"under another model name \('sequential[_0-9]*', this model is "
                                         r"'sequential_[0-9]+'\).*give the model a fixed name"):
        saved_and_loaded(None)


def test_a_mask_of_another_model_is_refused_even_when_layer_names_match(tmp_path):
    model = _model()
    mask = [st.trainable.rows(g, [0]) for g in row_groups(model)]
    save_mask(str(tmp_path), mask, model, provenance=MaskProvenance.public())
    wider = _model(width=4)  # same layer names, other kernel shapes
    with pytest.raises(ValueError, match="was selected for another model"):
        load_mask(str(tmp_path), wider)


def test_a_mask_is_charged_only_at_the_unit_it_was_chosen_for(tmp_path):
    """A user-level mask's entries say nothing about one example's add/remove (removing an example changes a
    user), nor an example-level mask's about a person: a run at the other unit is refused before a step."""
    x, y = gaussian_data(48, (6, 6, 1), 3)
    users = np.repeat(np.arange(16), 3)
    first = st.DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25, delta=1e-5, seed=0, unit="user",
                       examples_per_user=2)
    first.compile(tf.keras.optimizers.SGD(0.05), loss=XENT)
    first.fit(x, y, users=users, epochs=3, verbose=0,
              callbacks=[st.callbacks.SpartaCallback(warmup_epochs=1, mask_dir=str(tmp_path), verbose=0)])
    provenance = read_provenance(str(tmp_path))
    assert provenance.unit == "user" and provenance.entries
    assert MaskProvenance.from_meta({"privacy": {"private": True}}, "old").unit == "example"  # saved before units

    example_ledger = st.PrivacyLedger(1e-5)
    with pytest.raises(ValueError, match="chosen at unit 'user', this run's ledger protects one example"):
        provenance.charge(example_ledger, "m")
    assert not example_ledger.entries
    options = dict(method="sparta", target_epsilon=8.0, delta=1e-5, epochs=3, batch_size=12, dataset_size=48,
                   warmup_epochs=1, mask=str(tmp_path))
    with pytest.raises(ValueError, match="mask chosen by a run that protected one user, but this run protects one "
                                         "example"):
        st.make_private(_model(), **options)
    at_user_level = st.make_private(_model(), unit="user", **dict(options, dataset_size=16, batch_size=4))
    assert [e.phase for e in at_user_level.plan.events()][:2] == ["mask:warmup", "mask:selection"]


def test_a_resumed_run_must_train_with_the_mask_its_checkpoint_recorded(tmp_path):
    """A run killed after a checkpoint and resumed with another mask (another file, or the file replaced) would
    train coordinates that its restored ledger never charged: refused before a step; the same mask resumes."""
    from sparta_tf.checkpointing import CheckpointError

    x, y = gaussian_data(48, (6, 6, 1), 3)
    for name, row in (("a", 0), ("b", 1)):
        model = _model()
        save_mask(str(tmp_path / name), [st.trainable.rows(g, [row]) for g in row_groups(model)], model,
                  provenance=MaskProvenance.public(), method="hand-made")

    class KillAtSecondEpoch(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt

    def run(mask, callbacks=()):
        dp = st.make_private(_model(), method="sparta", target_epsilon=8.0, delta=1e-5, epochs=3, batch_size=12,
                             dataset_size=48, seed=0, warmup_epochs=1, mask=str(tmp_path / mask),
                             run_dir=str(tmp_path / "run"))
        dp.compile(tf.keras.optimizers.SGD(0.05), loss=XENT)
        dp.fit(x, y, verbose=0, callbacks=list(callbacks))
        return dp

    with pytest.raises(KeyboardInterrupt):
        run("a", [KillAtSecondEpoch()])
    with pytest.raises(CheckpointError, match=r"trained with another mask[^\n]*; resume with the mask the run"):
        run("b")
    resumed = run("a")
    assert int(resumed.dp_step.numpy()) == resumed.plan.steps


def test_a_mask_chosen_under_bands_is_charged_its_reduction():
    """Its entries keep their bands: 40 steps at b = 4 are ceil(40 / 4) = 10 runs of the mechanism, as the run
    that chose it charged them (they used to be charged as 40, about b times the cost)."""
    chooser = st.PrivacyLedger(1e-5)
    chooser.charge(st.privacy.ledger.LedgerEntry(1.0, 0.2, 40, "dp_sgd_step", "warmup", bands=4))
    model = _model()
    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        save_mask(directory, [st.trainable.rows(g, [0]) for g in row_groups(model)], model,
                  provenance=MaskProvenance.of_ledger(chooser), method="sparta")
        loader = st.PrivacyLedger(1e-5)
        read_provenance(directory).charge(loader, directory)
        loaded = methods.make_method("sparta", mask=directory).mechanisms_before_training(48, 0.25)
    assert [(e.count, e.bands, e.compositions) for e in loader.entries] == [(40, 4, 10)]
    assert loader.epsilon() == pytest.approx(chooser.epsilon(), rel=1e-9)
    assert [(m.count, m.bands, m.compositions) for m in loaded] == [(40, 4, 10)]


def test_a_mask_whose_choosing_run_was_killed_twice_is_charged_what_that_run_charged(tmp_path):
    """Two kills before one checkpoint: the choosing ledger holds two banded interrupted entries, ceil(3 / 4) +
    ceil(3 / 4) = 2 runs; loaded, as phase mask:interrupted, they stay two runs, not ceil(6 / 4) = 1."""
    chooser = st.PrivacyLedger(1e-5)
    for _ in range(2):
        chooser.charge(st.privacy.ledger.LedgerEntry(1.0, 0.2, 3, "dp_sgd_step", "interrupted", bands=4))
    chooser.charge(st.privacy.ledger.LedgerEntry(1.0, 0.2, 40, "dp_sgd_step", "warmup", bands=4))
    model = _model()
    save_mask(str(tmp_path), [st.trainable.rows(g, [0]) for g in row_groups(model)], model,
              provenance=MaskProvenance.of_ledger(chooser), method="sparta")
    loader = st.PrivacyLedger(1e-5)
    read_provenance(str(tmp_path)).charge(loader, str(tmp_path))
    assert [(e.phase, e.compositions) for e in loader.entries] == [("mask:interrupted", 1)] * 2 + [("mask:warmup", 10)]
    assert loader.epsilon() == pytest.approx(chooser.epsilon(), rel=1e-9)
    assert st.PrivacyLedger.from_json(loader.to_json()).epsilon() == loader.epsilon()  # a resumed run reads it again
