"""SPARTA end to end: private row selection, the three-phase fit, methods, masks."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf as st
from sparta_tf import methods
from sparta_tf.groups import parameter_table, row_groups
from sparta_tf.masks import MaskProvenance
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.selection import SelectionScorer, kept_count
from sparta_tf.trainable import VariableSelection
from small_models import LOSS as XENT
from small_models import gaussian_data
from small_models import variable_name as key

PLANTED = (2, 5, 11)


def planted_model(seed=0):
    """x -> hidden Dense(16) -> head; the head reads hidden units PLANTED with weight 1, others 1e-3.

    The gradient of the hidden kernel's row j is proportional to the head weight
    of unit j, so the PLANTED rows carry almost all of the gradient.
    """
    tf.keras.utils.set_random_seed(seed)
    inputs = tf.keras.Input((8,))
    hidden = tf.keras.layers.Dense(16, name="hidden")(inputs)
    logits = tf.keras.layers.Dense(2, name="head")(hidden)
    model = tf.keras.Model(inputs, logits)
    head = model.get_layer("head")
    weights = np.full((16, 2), 1e-3, np.float32)
    for j in PLANTED:
        weights[j] = [1.0, -1.0]
    head.kernel.assign(weights)
    return model


def dp_model(model, sigma, seed=0, q=0.25, **kwargs):
    dp = st.DPModel(model, noise_multiplier=sigma, sample_rate=q, seed=seed, **kwargs)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9), loss=XENT)
    return dp


def selected_rows(selections, variable):
    sel = [s for s in selections if s.variable is variable][0]
    return set(sel.rows.tolist())


def test_selection_recovers_planted_rows_at_small_noise():
    model = planted_model()
    x, y = gaussian_data(256, (8,), 2)
    selector = st.selection.SpartaSelector(model, density=3 / 16)
    selections = selector.select_epoch(dp_model(model, sigma=1e-3), x, y)
    assert selected_rows(selections, model.get_layer("hidden").kernel) == set(PLANTED)


def test_selection_is_chance_at_huge_noise():
    model = planted_model()
    x, y = gaussian_data(256, (8,), 2)
    hits = []
    for seed in range(12):
        selector = st.selection.SpartaSelector(model, density=3 / 16)
        selections = selector.select_epoch(dp_model(model, sigma=1e4, seed=seed), x, y)
        hits.append(len(selected_rows(selections, model.get_layer("hidden").kernel) & set(PLANTED)))
    # chance: 3 of 16 rows drawn, expected overlap 3 * 3/16 = 0.56 rows per run
    assert np.mean(hits) < 1.5


def test_selection_epoch_does_not_update_weights_and_counts_steps():
    model = planted_model()
    x, y = gaussian_data(256, (8,), 2)
    before = [v.numpy().copy() for v in model.weights]
    dp = dp_model(model, sigma=1.0, delta=1e-5)
    st.selection.SpartaSelector(model).select_epoch(dp, x, y)
    for b, v in zip(before, model.weights):
        assert np.array_equal(b, v.numpy())
    assert dp.ledger.steps == 4  # round(1/q) steps of the Gaussian mechanism


def _conv_model(seed=0):
    tf.keras.utils.set_random_seed(seed)
    inputs = tf.keras.Input((8, 8, 3))
    x = tf.keras.layers.Conv2D(8, 3, padding="same", name="conv1")(inputs)
    x = tf.keras.layers.GroupNormalization(4, name="gn1")(x)
    x = tf.keras.layers.ReLU()(x)
    x = tf.keras.layers.Conv2D(10, 3, strides=2, padding="same", use_bias=False, name="conv2")(x)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    x = tf.keras.layers.Dense(12, name="fc")(x)
    outputs = tf.keras.layers.Dense(3, name="head")(x)
    return tf.keras.Model(inputs, outputs)


def _conv_data(n=96, seed=0):
    return gaussian_data(n, (8, 8, 3), 3, seed)


def test_per_layer_density_and_overrides():
    model = _conv_model()
    x, y = _conv_data()
    selector = st.selection.SpartaSelector(model, density=0.3, density_overrides={"fc": 0.5, "conv2/*": 0.0})
    selections = selector.select_epoch(dp_model(model, sigma=1.0), x, y)
    kept = {key(s.variable): (len(s.rows) if s.kind == "rows" else s.group.n_rows) for s in selections}
    assert kept["conv1/kernel"] == kept_count(8, 0.3) == 2
    assert kept["fc/kernel"] == 6
    assert "conv2/kernel" not in kept  # density 0: no row of conv2 is trained
    assert kept_count(10, 0.01) == 1  # at least one row when density > 0


def test_three_phase_fit_freezes_unselected_coordinates_and_counts_T_epochs(tmp_path):
    model = _conv_model()
    x, y = _conv_data()
    before = {key(v): v.numpy().copy() for v in model.trainable_variables}
    dp = dp_model(model, sigma=0.8, delta=1e-5)
    epochs, warmup = 4, 1
    callback = st.callbacks.SpartaCallback(warmup_epochs=warmup, density=0.25, mask_dir=str(tmp_path), verbose=0)
    dp.fit(x, y, epochs=epochs, callbacks=[callback], verbose=0)

    steps_per_epoch = round(1 / 0.25)
    assert dp.ledger.steps == epochs * steps_per_epoch
    phases = {}
    for entry in dp.ledger.entries:
        phases[entry.phase] = phases.get(entry.phase, 0) + entry.count
    assert phases == {"warmup": steps_per_epoch, "selection": steps_per_epoch, "sparse": 2 * steps_per_epoch}

    mask = {key(s.variable): s for s in callback.mask_selections}
    for info in parameter_table(model):
        old, new = before[key(info.variable)], info.variable.numpy()
        if info.group is None:
            assert not np.array_equal(old, new), f"{key(info.variable)} ({info.role}) should train"
            continue
        sel = mask[key(info.variable)]
        trained = sel.dense_mask()
        assert np.array_equal(old[~trained], new[~trained]), f"frozen coordinates of {key(info.variable)} moved"
        assert not np.array_equal(old[trained], new[trained])
    assert os.path.exists(tmp_path / "mask.npz")


def test_trainable_set_of_every_method():
    model = _conv_model()
    roles = {key(v): p.role for p in parameter_table(model) for v in [p.variable]}

    def roles_of(trainable_set):
        return sorted({roles[key(s.variable)] for s in trainable_set})

    assert roles_of(methods.trainable_set(model, "all")) == ["bias", "head", "kernel", "norm"]
    assert roles_of(methods.trainable_set(model, "last")) == ["head", "norm"]
    assert roles_of(methods.trainable_set(model, "bitfit")) == ["bias", "head", "norm"]
    assert all(s.kind == "dense" for s in methods.trainable_set(model, "bitfit"))
    for method in ("sparta", "dpsgd_grad", "oracle", "mp", "random"):
        with pytest.raises(ValueError, match="needs a mask"):
            methods.trainable_set(model, method)
    with pytest.raises(ValueError, match="unknown method"):
        methods.method_class("lora")


def test_mp_keeps_largest_pretrained_magnitudes_and_random_is_seeded():
    from sparta_tf.selection import magnitude_selections, random_selections

    model = _conv_model()
    groups = row_groups(model)
    for sel, group in zip(magnitude_selections(groups, 0.2), groups):
        assert sel.kind == "entries"
        weights = np.abs(group.variable.numpy()).reshape(-1)
        kept = weights[sel.entries]
        dropped = np.delete(weights, sel.entries)
        assert kept.min() >= dropped.max()
        assert sel.size == kept_count(weights.size, 0.2)
    a = random_selections(groups, 0.5, "row", seed=1)
    b = random_selections(groups, 0.5, "row", seed=1)
    c = random_selections(groups, 0.5, "row", seed=2)
    assert all(np.array_equal(s.rows, t.rows) for s, t in zip(a, b))
    assert any(not np.array_equal(s.rows, t.rows) for s, t in zip(a, c))


@pytest.mark.parametrize("method", ["mp", "random", "bitfit", "last"])
def test_static_methods_fit_without_selection_epoch(method):
    model = _conv_model()
    x, y = _conv_data()
    dp = dp_model(model, sigma=1.0, delta=1e-5)
    options = {"density": 0.2} if method in ("mp", "random") else {}
    callback = st.callbacks.MethodCallback(method, verbose=0, **options)
    history = dp.fit(x, y, epochs=2, callbacks=[callback], verbose=0)
    assert {e.phase for e in dp.ledger.entries} == {method}
    expected = methods.trainable_set(model, method, callback.mask_selections).fraction_of(model)
    assert history.history["trainable_fraction"][-1] == pytest.approx(expected)


def test_oracle_marks_the_run_not_private():
    model = _conv_model()
    x, y = _conv_data()
    dp = dp_model(model, sigma=1.0, delta=1e-5)
    dp.fit(x, y, epochs=3, callbacks=[st.callbacks.MethodCallback("oracle", warmup_epochs=1, verbose=0)], verbose=0)
    assert not dp.ledger.is_private
    assert "oracle" in " ".join(dp.ledger.nonprivate_reasons)


def test_a_standalone_oracle_selection_epoch_marks_the_ledger_not_private():
    """Regression: SpartaSelector.select_epoch with score="oracle" (no clipping, no noise) left the
    ledger private; only the MethodCallback path marked it."""
    model = _conv_model()
    x, y = _conv_data()
    dp = dp_model(model, sigma=1.0, delta=1e-5)
    st.selection.SpartaSelector(model, density=0.25, score="oracle").select_epoch(dp, x, y)
    assert not dp.ledger.is_private and "oracle" in " ".join(dp.ledger.nonprivate_reasons)


def test_dpsgd_grad_selects_entries():
    model = _conv_model()
    x, y = _conv_data()
    dp = dp_model(model, sigma=1.0)
    callback = st.callbacks.MethodCallback("dpsgd_grad", warmup_epochs=0, density=0.1, verbose=0)
    dp.fit(x, y, epochs=2, callbacks=[callback], verbose=0)
    assert {s.kind for s in callback.mask_selections} == {"entries"}


def test_mask_save_load_round_trip(tmp_path):
    model = _conv_model()
    groups = row_groups(model)
    selections = [
        st.trainable.rows(groups[0], [1, 4]),
        st.trainable.entries(groups[1].variable, np.random.default_rng(0).random(groups[1].shape) < 0.3),
    ]
    st.masks.save_mask(str(tmp_path), selections, model, provenance=MaskProvenance.public(), method="sparta",
                 density=0.2)
    loaded, meta = st.masks.load_mask(str(tmp_path), model)
    assert {k: meta[k] for k in ("method", "density")} == {"method": "sparta", "density": 0.2}
    assert MaskProvenance.from_meta(meta, "m") == MaskProvenance.public()
    assert [(key(s.variable), s.kind) for s in loaded] == [(key(s.variable), s.kind) for s in selections]
    assert np.array_equal(loaded[0].rows, [1, 4])
    assert np.array_equal(loaded[1].entries, selections[1].entries)
    summary = json.loads((tmp_path / "mask.json").read_text())
    conv1 = [r for r in summary["layers"] if r["layer"] == "conv1"][0]
    assert (conv1["kept"], conv1["total"]) == (2, 8)
    assert "| conv1 |" in (tmp_path / "mask.md").read_text()
    other = _conv_model(seed=1)
    tf.keras.backend.clear_session()
    renamed = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2, name="head")])
    with pytest.raises(ValueError, match="was selected for another model"):
        st.masks.load_mask(str(tmp_path), renamed)
    del other


def test_loaded_mask_skips_selection(tmp_path):
    model = _conv_model()
    x, y = _conv_data()
    mask = [st.trainable.rows(g, [0]) for g in row_groups(model)]
    st.masks.save_mask(str(tmp_path), mask, model, provenance=MaskProvenance.public(), method="sparta")
    dp = dp_model(model, sigma=1.0, delta=1e-5)
    callback = st.callbacks.SpartaCallback(warmup_epochs=1, mask=str(tmp_path), verbose=0)
    dp.fit(x, y, epochs=2, callbacks=[callback], verbose=0)
    assert {e.phase for e in dp.ledger.entries} == {"warmup", "sparse"}
    assert {key(s.variable): s.rows.tolist() for s in callback.mask_selections if s.kind == "rows"} == {
        key(s.variable): [0] for s in mask
    }


def test_too_many_warmup_epochs_is_a_clear_error():
    model = _conv_model()
    x, y = _conv_data()
    dp = dp_model(model, sigma=1.0)
    with pytest.raises(ValueError, match="warmup_epochs=2 leaves no sparse epoch"):
        dp.fit(x, y, epochs=3, callbacks=[st.callbacks.SpartaCallback(warmup_epochs=2, verbose=0)], verbose=0)


def _scorer(score, granularity="row"):
    model = _conv_model()
    group = row_groups(model)[-1]  # fc: [10, 12]
    return SelectionScorer([group], DpSgdMechanism(0.0, 1.0, clip_norm=1e6), score=score, granularity=granularity), group


def test_abs_sum_and_sum_abs_differ_where_gradients_cancel():
    """Two examples with opposite gradients on row 0, equal gradients on row 1."""
    grads = np.zeros((2, 10, 12), np.float32)
    grads[0, :, 0], grads[1, :, 0] = 1.0, -1.0
    grads[:, :, 1] = 0.5
    valid = tf.constant([True, True])
    results = {}
    for score in ("sum_abs", "abs_sum"):
        scorer, _ = _scorer(score)
        stats = scorer.batch_statistic([tf.constant(grads)], valid)
        scorer.release(stats, tf.constant(1, tf.int64), tf.constant(0, tf.int64))
        results[score] = scorer.scores()[0]
    assert results["sum_abs"][0] == pytest.approx(20.0)  # sum_i |g_i|: 2 examples x 10 coordinates
    assert results["abs_sum"][0] == pytest.approx(0.0)  # |sum_i g_i| cancels
    assert results["sum_abs"][1] == pytest.approx(results["abs_sum"][1]) == pytest.approx(10.0)


def test_scores_are_clipped_per_example_and_noise_has_row_variance():
    grads = np.zeros((1, 10, 12), np.float32)
    grads[0, :, 3] = 100.0  # norm 100 * sqrt(10): clipped to C = 1
    model = _conv_model()
    group = row_groups(model)[-1]
    scorer = SelectionScorer([group], DpSgdMechanism(0.0, 1.0, clip_norm=1.0))
    scorer.release(scorer.batch_statistic([tf.constant(grads)], tf.constant([True])), tf.constant(0, tf.int64),
                   tf.constant(0, tf.int64))
    assert scorer.scores()[0][3] == pytest.approx(np.sqrt(10.0), rel=1e-4)  # ||u||_2 = C, l1 = sqrt(10) C
    noisy = SelectionScorer([group], DpSgdMechanism(2.0, 1.0, clip_norm=1.0))
    zeros = [tf.zeros([12])]
    draws = []
    for step in range(300):
        noisy.reset()
        noisy.release(zeros, tf.constant(7, tf.int64), tf.constant(step, tf.int64))
        draws.append(noisy.scores()[0])
    # per row: sum of row_size=10 coordinates with N(0, (sigma C)^2) each
    assert np.std(np.concatenate(draws)) == pytest.approx(2.0 * np.sqrt(10.0), rel=0.06)


def test_signed_score_requires_entry_granularity():
    with pytest.raises(ValueError, match="granularity='entry'"):
        _scorer("signed", "row")


def test_selection_set_has_no_per_example_leak_in_outputs():
    """Only the accumulators and the step counter are state of the scorer."""
    scorer, _ = _scorer("sum_abs")
    assert {v.name.split(":")[0] for v in scorer.variables} == {"score_0", "score_steps"}


def test_variable_selection_rejects_inconsistent_input():
    model = _conv_model()
    with pytest.raises(ValueError, match="mask shape"):
        st.trainable.entries(model.get_layer("fc").kernel, np.ones((3, 3), bool))
    with pytest.raises(ValueError, match="out of range"):
        st.trainable.rows(row_groups(model)[0], [99])
    with pytest.raises(ValueError, match="needs its RowGroup"):
        VariableSelection(model.get_layer("fc").kernel, "rows")


def test_x_bitfit_switches_from_all_to_bias_terms_at_epoch_x():
    model = _conv_model()
    x, y = _conv_data()
    dp = dp_model(model, sigma=0.5, delta=1e-5)
    callback = st.callbacks.MethodCallback("x_bitfit", full_epochs=1, verbose=0)
    before = {key(v): v.numpy().copy() for v in model.trainable_variables}
    dp.fit(x, y, epochs=1, callbacks=[callback], verbose=0)
    assert {e.phase for e in dp.ledger.entries} == {"full"}
    assert all(not np.array_equal(before[key(v)], v.numpy()) for v in model.trainable_variables)
    after_full = {key(v): v.numpy().copy() for v in model.trainable_variables}
    dp.fit(x, y, epochs=3, initial_epoch=1, callbacks=[callback], verbose=0)
    phases = [e.phase for e in dp.ledger.entries]
    assert phases == ["full", "bias_terms"]
    trained = {key(s.variable) for s in dp.trainable_set}
    assert trained == {"conv1/bias", "gn1/beta", "fc/bias", "head/bias"}
    for v in model.trainable_variables:
        moved = not np.array_equal(after_full[key(v)], v.numpy())
        assert moved == (key(v) in trained), key(v)


def test_bias_only_step_computes_no_per_example_weight_gradients():
    """DP-BiTFiT's efficiency point: no per-example products of activations at all."""
    from sparta_tf.losses import per_example_loss_fn
    from sparta_tf.per_example import make_engine

    model = _conv_model()
    x, y = _conv_data(8)
    loss = per_example_loss_fn(XENT)

    def op_types(trainable_set):
        engine = make_engine(model, trainable_set, materialise=True)
        fn = tf.function(lambda: engine(tf.constant(x), tf.constant(y), loss, tf.ones([8], bool)).grads)
        return {op.type for op in fn.get_concrete_function().graph.get_operations()}

    full = op_types(methods.trainable_set(model, "all"))
    bias_only = op_types(methods.bias_terms_set(model))
    weight_grad_ops = {"BatchMatMulV2", "DepthwiseConv2dNative"}
    assert full & weight_grad_ops
    assert not bias_only & weight_grad_ops
