"""The book-keeping engine: per-example norms and clipped sums equal the materialising engine's,
without a [B, *kernel.shape] tensor, with padding and clipping exact."""

import math

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf import trainable as trainable_lib
from sparta_tf.backend import variable_key
from sparta_tf.groups import row_groups
from sparta_tf.per_example import RecordedCall, make_engine, registry
from sparta_tf.per_example.bookkeeping import BookkeepingEngine, clipped_batch
from sparta_tf.per_example.rules import ghost_norms
from sparta_tf.privacy.mechanism import DpSgdMechanism

L = tf.keras.layers


def loss_fn(y, p):
    return tf.keras.losses.sparse_categorical_crossentropy(y, p, from_logits=True)


class Scale(L.Layer):
    """A custom layer (no rule): y = x * w, w per channel."""

    def build(self, shape):
        self.w = self.add_weight(name="w", shape=shape[-1:], initializer="random_normal")

    def call(self, x):
        return x * self.w


def _conv_model(layer, shape=(9, 9, 4)):
    inputs = tf.keras.Input(shape)
    return tf.keras.Model(inputs, L.Dense(3)(L.Flatten()(layer(inputs))))


def _sequence_model(layer, shape=(5, 6)):
    inputs = tf.keras.Input(shape)
    return tf.keras.Model(inputs, L.Dense(3)(L.Flatten()(layer(inputs))))


def _mha_model():
    inputs = tf.keras.Input((5, 8))
    attended = L.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
    return tf.keras.Model(inputs, L.Dense(3)(L.Flatten()(attended)))


def _embedding_model():
    inputs = tf.keras.Input((6,), dtype=tf.int32)
    return tf.keras.Model(inputs, L.Dense(3)(L.Flatten()(L.Embedding(7, 4)(inputs))))


MODELS = {
    "dense_2d": lambda: tf.keras.Sequential([tf.keras.Input((6,)), L.Dense(5), L.Dense(3)]),
    "dense_3d": lambda: _sequence_model(L.Dense(4)),
    "einsum_dense": lambda: _sequence_model(L.EinsumDense("abc,cde->abde", output_shape=(5, 2, 3), bias_axes="de")),
    "multi_head_attention": _mha_model,
    "conv1d": lambda: _sequence_model(L.Conv1D(4, 3, padding="same")),
    "conv2d_same": lambda: _conv_model(L.Conv2D(5, 3, padding="same")),
    "conv2d_valid_stride": lambda: _conv_model(L.Conv2D(5, 3, strides=2, padding="valid")),
    "conv2d_dilation": lambda: _conv_model(L.Conv2D(5, 3, dilation_rate=2, padding="same")),
    "conv2d_one_position": lambda: _conv_model(L.Conv2D(5, 3, padding="same"), shape=(1, 1, 4)),
    "conv1d_one_position": lambda: _sequence_model(L.Conv1D(4, 5, padding="valid")),
    "conv2d_groups": lambda: _conv_model(L.Conv2D(6, 3, groups=2, padding="same")),
    "depthwise": lambda: _conv_model(L.DepthwiseConv2D(3, padding="same")),
    "separable": lambda: _conv_model(L.SeparableConv2D(5, 3, padding="same")),
    "embedding": _embedding_model,
    "group_norm": lambda: _conv_model(L.GroupNormalization(2)),
    "layer_norm": lambda: _sequence_model(L.LayerNormalization()),
    "custom": lambda: _sequence_model(Scale()),
}


def _inputs(model, batch=5):
    shape = model.inputs[0].shape[1:]
    if model.inputs[0].dtype == tf.int32:
        return tf.random.uniform([batch, *shape], 0, 7, tf.int32)
    return tf.random.normal([batch, *shape])


def _selections(model, rows: bool):
    groups = {variable_key(g.variable): g for g in row_groups(model)}
    selections = []
    for variable in model.trainable_variables:
        group = groups.get(variable_key(variable))
        if rows and group is not None and group.n_rows > 2:
            selections.append(trainable_lib.rows(group, [0, group.n_rows - 1]))
        else:
            selections.append(trainable_lib.dense(variable))
    return selections


def _compare(model, selections, x, y, valid, clip_norm, margin=0.0, max_memory=None):
    """Book-keeping (``max_memory=0``: the two-pass step) against the layer-wise engine. ``margin``:
    how far above the exact squared norms ours may lie (the ghost norm's rounding margin,
    ``gram_squared_norms``); never below."""
    bookkeeping = make_engine(model, selections, "auto", max_memory=max_memory)
    assert isinstance(bookkeeping, BookkeepingEngine)
    reference = make_engine(model, selections, "layerwise")
    ours = tf.function(lambda: clipped_batch(bookkeeping, x, y, loss_fn, valid, clip_norm))()
    theirs = tf.function(lambda: clipped_batch(reference, x, y, loss_fn, valid, clip_norm))()
    ours_norms, their_norms = (n.squared_norms.numpy()[valid.numpy()] for n in (ours, theirs))
    assert np.all(ours_norms >= their_norms * (1 - 1e-5)), (ours_norms, their_norms)
    np.testing.assert_allclose(ours_norms, their_norms, rtol=1e-5 + margin)
    # relative to the largest coordinate of the step (some gradients are exactly zero in theory,
    # e.g. attention's key bias, and only rounding noise in practice)
    scale = max(float(np.max(np.abs(b.numpy()))) for b in theirs.sums) + 1e-12
    for selection, a, b in zip(selections, ours.sums, theirs.sums):
        assert a.shape == b.shape, selection.variable.name
        np.testing.assert_allclose(a.numpy() / scale, b.numpy() / scale, atol=1e-5 + margin,
                                   err_msg=selection.variable.name)
    if clip_norm >= 1e3:  # nothing clipped: the sums are the batch gradient (a probe that never fired gives 0s)
        _assert_sums_are_the_batch_gradient(model, selections, x, y, valid, ours.sums, scale)
    return bookkeeping


def _assert_sums_are_the_batch_gradient(model, selections, x, y, valid, sums, scale):
    """``sum_i g_i`` over the valid examples equals the tape gradient of ``sum_i valid_i L_i``, restricted
    to each selection's coordinates (its compact shape)."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loss_fn(y, model(x)) * tf.cast(valid, tf.float32))
    gradients = tape.gradient(loss, [s.variable for s in selections])
    for selection, total, gradient in zip(selections, sums, gradients):
        full = tf.zeros(selection.variable.shape) if gradient is None else tf.convert_to_tensor(gradient)
        expected = selection.compact(full).numpy()
        np.testing.assert_allclose(total.numpy() / scale, expected / scale, atol=1e-4,
                                   err_msg=f"{variable_key(selection.variable)}: not the batch gradient")


@pytest.mark.parametrize("rows", [False, True], ids=["whole", "rows"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_norms_and_clipped_sums_equal_the_materialising_engine(name, rows):
    tf.random.set_seed(1)
    model = MODELS[name]()
    x, y = _inputs(model), tf.constant([0, 1, 2, 0, 1])
    valid = tf.constant([True, True, True, True, False])
    for clip_norm in (1e-3, 1e3):  # every example clipped / none clipped
        # Ghost and index-equality norms are raised by their rounding bound, up to 2 gamma_n T of the
        # squared norm (gram_squared_norms; the embedding's T = 6, n = 16: 1.1e-5 in float32).
        _compare(model, _selections(model, rows), x, y, valid, clip_norm, margin=2e-5)


@pytest.mark.parametrize("method", ["ghost", "direct"])
@pytest.mark.parametrize("name", ["dense_3d", "einsum_dense", "conv2d_same", "conv2d_valid_stride"])
def test_ghost_norm_and_direct_norm_both_exact(name, method, monkeypatch):
    monkeypatch.setattr(ghost_norms, "choose_linear_norm",
                        lambda t, d, p: ("rank_one", None, 0) if t == 1 else (method, 1, 1))
    tf.random.set_seed(2)
    model = MODELS[name]()
    # the ghost norm's rounding margin: at most 2 gamma_n T of the squared norm (n = 2T + d + p;
    # 2e-3 for conv2d_same's 81 positions)
    engine = _compare(model, _selections(model, rows=True), _inputs(model), tf.constant([0, 1, 2, 0, 1]),
                      tf.ones([5], bool), 0.5, margin=2e-3 if method == "ghost" else 0.0)
    assert method in {row.method for row in engine.cost_table()}


def test_cost_model_picks_the_cheaper_norm_and_the_table_says_which():
    assert ghost_norms.choose_linear_norm(1, 100, 10)[0] == "rank_one"
    assert ghost_norms.choose_linear_norm(4, 512, 512) == ("ghost", 16 * 1024, 4 * 512 * 512)
    assert ghost_norms.choose_linear_norm(1024, 27, 16)[0] == "direct"
    model = tf.keras.Sequential([tf.keras.Input((4, 4, 64)), L.Conv2D(64, 3, padding="same"), L.Flatten(), L.Dense(3)])
    engine = make_engine(model, model.trainable_variables)
    tf.function(lambda: engine.clipped_sum(tf.random.normal([2, 4, 4, 64]), tf.constant([0, 1]), loss_fn,
                                           tf.ones([2], bool), 1.0))()
    methods = {row.variable: row.method for row in engine.cost_table()}
    assert methods[variable_key(model.layers[0].kernel)] == "ghost"  # 16^2 (576 + 64) < 16 * 576 * 64
    assert methods[variable_key(model.layers[-1].kernel)] == "rank_one"


def _kernel_sized_tensors(graph, batch, kernels):
    sizes = {batch * int(np.prod(k)) for k in kernels}
    found = []
    for op in graph.get_operations():
        for out in op.outputs:
            shape = out.shape
            if shape.rank and shape.is_fully_defined() and shape[0] == batch and shape.num_elements() in sizes:
                found.append((op.type, op.name, shape))
    return found


@pytest.mark.parametrize("shape", [(4, 4, 24), (1, 1, 24)], ids=["ghost", "one_position"])
def test_a_step_of_rule_covered_layers_never_materialises_per_example_kernel_gradients(shape):
    """On a 1x1 map (a 3x3 convolution at ResNet50V2's last stage on 32x32 images) the kernel's norm is
    rank one, ``||P(a_i)||^2 ||delta_i||^2``: never its ``B x 3 x 3 x c_in x c_out`` per-example gradients."""
    batch = 7
    model = tf.keras.Sequential([tf.keras.Input(shape), L.Conv2D(40, 3, padding="same", use_bias=False),
                                 L.GroupNormalization(4), L.Flatten(), L.Dense(33), L.Dense(5)])
    engine = make_engine(model, model.trainable_variables)
    x, y = tf.random.normal([batch, *shape]), tf.zeros([batch], tf.int32)
    graph = tf.function(lambda: engine.clipped_sum(x, y, loss_fn, tf.ones([batch], bool), 1.0).sums) \
        .get_concrete_function().graph
    kernels = [v.shape for v in model.trainable_variables if "kernel" in v.name]
    assert _kernel_sized_tensors(graph, batch, kernels) == []
    # the check can fail: the materialising engine's graph has them
    reference = make_engine(model, model.trainable_variables, "layerwise")
    reference_graph = tf.function(lambda: clipped_batch(reference, x, y, loss_fn, tf.ones([batch], bool), 1.0).sums) \
        .get_concrete_function().graph
    assert _kernel_sized_tensors(reference_graph, batch, kernels)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_two_pass_step_equals_the_materialising_engine(name, rows=True):
    """No room to keep output gradients (``max_memory=0``): norms and sums computed inside two
    backward passes, still exact; a layer whose output cannot be tapped (a separable convolution's
    two probes) keeps its output gradient."""
    tf.random.set_seed(1)
    model = MODELS[name]()
    x, y = _inputs(model), tf.constant([0, 1, 2, 0, 1])
    valid = tf.constant([True, True, True, True, False])
    for clip_norm in (1e-3, 1e3):
        engine = _compare(model, _selections(model, rows), x, y, valid, clip_norm, margin=2e-5, max_memory=0)
        plan = engine.memory_plan()
        assert plan.mode == "two_pass" and plan.kept_bytes < plan.one_pass_bytes
        assert "streamed" in {row.output_gradient for row in engine.cost_table()}


def test_the_memory_budget_picks_one_or_two_passes_and_the_plan_says_what_is_kept():
    model = tf.keras.Sequential([tf.keras.Input((8, 8, 3)), L.Conv2D(8, 3, padding="same", name="conv_a"),
                                 L.GroupNormalization(2, name="norm"), L.ReLU(),
                                 L.Conv2D(8, 3, name="conv_b"), L.Flatten(), L.Dense(4, name="head")])
    x, y, valid = tf.random.normal([6, 8, 8, 3]), tf.constant([0, 1, 2, 3, 0, 1]), tf.ones([6], bool)
    # the most one pass keeps: 1.25x every probed output gradient, float32 (conv, group norm, conv, dense)
    one_pass = math.ceil(1.25 * 4 * 6 * (8 * 8 * 8 * 2 + 6 * 6 * 8 + 4))
    # with taps, each layer keeps its per-example gradients where they take at most 1.25x its output
    # gradient: conv_a's kernel and bias (3*3*3*8 + 8 = 224 against 512 a row) and the norm's gamma
    # and beta (16); else its output gradient: conv_b's (288 against 3*3*8*8 + 8 = 584) and the
    # head's (rank-one norms: none materialised)
    kept_one_pass = 4 * 6 * ((3 * 3 * 3 * 8 + 8) + (8 + 8) + 6 * 6 * 8 + 4)
    kept_by_layer = {"conv_a": "per_example", "norm": "per_example", "conv_b": "kept", "head": "kept"}
    for budget, mode, kept in [(one_pass, "one_pass", kept_one_pass), (one_pass - 1, "two_pass", 0)]:
        engine = make_engine(model, model.trainable_variables, max_memory=budget)
        tf.function(lambda: engine.clipped_sum(x, y, loss_fn, valid, 1.0).sums)()
        assert engine.memory_plan() == (mode, budget, one_pass, kept)
        assert engine.memory_plan().kept_bytes <= budget
        expected = {name: "streamed" for name in kept_by_layer} if mode == "two_pass" else kept_by_layer
        assert {row.layer: row.output_gradient for row in engine.cost_table()} == expected
        for clip_norm in (1e-3, 1e3):  # what each layer kept gives the exact clipped sums
            _compare(model, _selections(model, rows=False), x, y, valid, clip_norm, margin=2e-5, max_memory=budget)


@pytest.mark.parametrize("max_memory", [None, 0], ids=["one_pass", "two_pass"])
def test_padded_and_non_finite_examples_contribute_exactly_zero(max_memory):
    tf.random.set_seed(3)
    model = MODELS["conv2d_same"]()
    engine = make_engine(model, _selections(model, rows=True), max_memory=max_memory)
    x = _inputs(model)
    y = tf.constant([0, 1, 2, 0, 1])
    valid = tf.constant([True, True, False, True, False])
    step = tf.function(lambda x: engine.clipped_sum(x, y, loss_fn, valid, 1.0).sums)
    base = step(x)
    poisoned = tf.tensor_scatter_nd_update(x, [[2], [4]], tf.stack([tf.fill(x.shape[1:], np.inf),
                                                                     tf.fill(x.shape[1:], np.nan)]))
    for a, b in zip(base, step(poisoned)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # bit-identical: padding cannot leak


@pytest.mark.parametrize("max_memory", [None, 0], ids=["one_pass", "two_pass"])
def test_an_example_whose_gradient_overflows_is_dropped_without_touching_the_others(max_memory):
    """A finite input whose activations overflow: its norm is not finite, so it is dropped; in the
    two-pass step its ``nan`` output gradients are zeroed at every tap, not summed into the others'."""
    tf.random.set_seed(5)
    model = MODELS["conv2d_same"]()
    engine = make_engine(model, _selections(model, rows=False), max_memory=max_memory)
    x, y = _inputs(model), tf.constant([0, 1, 2, 0, 1])
    step = tf.function(lambda x, valid: engine.clipped_sum(x, y, loss_fn, valid, 1.0).sums)
    huge = tf.tensor_scatter_nd_update(x, [[1]], [tf.fill(x.shape[1:], 3e38)])
    without = step(x, tf.constant([True, False, True, True, True]))
    for a, b in zip(without, step(huge, tf.ones([5], bool))):
        assert np.all(np.isfinite(b.numpy()))
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("max_memory", [None, 0], ids=["one_pass", "two_pass"])
def test_every_example_contributes_at_most_the_clip_norm(max_memory):
    tf.random.set_seed(4)
    model = MODELS["dense_3d"]()
    engine = make_engine(model, model.trainable_variables, max_memory=max_memory)
    x = 100.0 * _inputs(model)
    y = tf.argmin(model(x), axis=-1, output_type=tf.int32)  # the least likely class: a large gradient
    for i in range(3):
        only = tf.one_hot(i, 5) > 0
        sums = engine.clipped_sum(x, y, loss_fn, only, 0.25).sums
        norm = np.sqrt(sum(float(tf.reduce_sum(tf.square(s))) for s in sums))
        assert norm <= 0.25 * (1 + 1e-6) and norm > 0.2


def test_a_layer_called_twice_is_clipped_on_the_sum_of_its_calls():
    shared = L.Dense(4)
    inputs = tf.keras.Input((6,))
    model = tf.keras.Model(inputs, L.Dense(3)(shared(L.Activation("tanh")(shared(L.Dense(4)(inputs))))))
    x, y = tf.random.normal([5, 6]), tf.constant([0, 1, 2, 0, 1])
    engine = _compare(model, _selections(model, rows=False), x, y, tf.ones([5], bool), 0.1)
    assert "direct_shared_layer" in {row.method for row in engine.cost_table()}


def _tf_privacy_norms(computation, layer, args, delta_seed):
    with tf.GradientTape() as tape:
        base_vars, outputs, sqr_norm_fn = computation(layer, args, {}, tape)[:3]
        weights = tf.random.stateless_normal(tf.shape(outputs), [delta_seed, 0])
        total = tf.reduce_sum(outputs * weights)
    return sqr_norm_fn(tape.gradient(total, base_vars)), weights


@pytest.mark.parametrize("kind", ["dense", "dense_3d", "einsum_dense", "layer_norm", "embedding"])
def test_our_norms_equal_tf_privacy_registry_functions(kind):
    tfp_dense = pytest.importorskip("tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions.dense")
    from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import (
        einsum_dense, embedding, layer_normalization)

    tf.random.set_seed(5)
    layer, inputs, computation = {
        "dense": (L.Dense(4), tf.random.normal([6, 5]), tfp_dense.dense_layer_computation),
        "dense_3d": (L.Dense(4), tf.random.normal([6, 3, 5]), tfp_dense.dense_layer_computation),
        "einsum_dense": (L.EinsumDense("abc,cd->abd", output_shape=(3, 4), bias_axes="d"),
                         tf.random.normal([6, 3, 5]), einsum_dense.einsum_layer_computation),
        "layer_norm": (L.LayerNormalization(), tf.random.normal([6, 5]),
                       layer_normalization.layer_normalization_computation),
        "embedding": (L.Embedding(7, 4), tf.random.uniform([6, 3], 0, 7, tf.int32),
                      embedding.embedding_layer_computation),
    }[kind]
    layer(inputs)  # build
    theirs, delta = _tf_privacy_norms(computation, layer, (inputs,), 11)
    rule = registry.ghost_rule_for(layer)
    call = RecordedCall(layer, (inputs,), {}, None, type(layer).call.__get__(layer))
    selections = [trainable_lib.dense(v) for v in layer.trainable_variables]
    ours, _ = rule.squared_norms(layer, call, delta, selections)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5)


@pytest.mark.parametrize("score, granularity", [("sum_abs", "row"), ("oracle", "row"), ("abs_sum", "row"),
                                                ("signed", "entry")])
@pytest.mark.parametrize("name", ["dense_2d", "dense_3d", "conv2d_same", "einsum_dense", "conv2d_groups"])
def test_selection_statistics_equal_the_materialising_engine(name, score, granularity):
    from sparta_tf.selection.scoring import SelectionScorer

    tf.random.set_seed(6)
    model = MODELS[name]()
    scorer = SelectionScorer(row_groups(model), DpSgdMechanism(1.0, 1.0, clip_norm=0.05), score=score,
                             granularity=granularity)
    assert scorer.bookkeeping_statistic
    x, y = _inputs(model), tf.constant([0, 1, 2, 0, 1])
    valid = tf.constant([True, True, False, True, True])
    engine = make_engine(model, scorer.selections)
    assert isinstance(engine, BookkeepingEngine)
    ours = tf.function(lambda: scorer.batch_statistic_bookkeeping(engine, x, y, loss_fn, valid)[0])()
    reference = make_engine(model, scorer.selections, "layerwise")
    theirs = tf.function(lambda: scorer.batch_statistic(reference(x, y, loss_fn, valid).grads, valid))()
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6 * float(np.max(np.abs(b))))


def test_entrywise_sum_abs_still_uses_per_example_gradients():
    from sparta_tf.selection.scoring import SelectionScorer

    model = MODELS["dense_2d"]()
    scorer = SelectionScorer(row_groups(model), DpSgdMechanism(1.0, 1.0, clip_norm=1.0), score="sum_abs",
                             granularity="entry")
    assert not scorer.bookkeeping_statistic


def test_dp_model_uses_the_bookkeeping_engine_by_default_and_shows_its_choices():
    from sparta_tf import DPModel

    model = MODELS["dense_2d"]()
    dp_model = DPModel(model, clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, dataset_size=8, seed=1)
    dp_model.compile(tf.keras.optimizers.SGD(0.1), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert dp_model.engine_cost_table() == []
    dp_model.train_on_batch(tf.random.normal([4, 6]), tf.constant([0, 1, 2, 0]), sample_weight=tf.ones([4]))
    methods = {row.variable: row.method for row in dp_model.engine_cost_table()}
    assert methods[variable_key(model.layers[0].kernel)] == "rank_one"


def test_dp_model_takes_a_memory_budget_and_says_how_its_step_kept_output_gradients():
    from sparta_tf import DPModel

    with pytest.raises(ValueError, match=r"^max_memory='2 gigs': give a size in bytes >= 0[^\n]*$"):
        DPModel(MODELS["dense_2d"](), clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, max_memory="2 gigs")
    results, x = {}, tf.random.normal([4, 6])
    for budget in ("1GiB", 0):
        tf.keras.utils.set_random_seed(6)
        model = MODELS["dense_2d"]()
        dp_model = DPModel(model, clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5, dataset_size=8, seed=1,
                           max_memory=budget)
        dp_model.compile(tf.keras.optimizers.SGD(0.1),
                         loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        assert dp_model.engine_memory_plan() is None
        dp_model.train_on_batch(x, tf.constant([0, 1, 2, 0]), sample_weight=tf.ones([4]))
        results[budget] = (dp_model.engine_memory_plan(), [v.numpy() for v in model.trainable_variables])
    assert results["1GiB"][0].mode == "one_pass" and results["1GiB"][0].budget == 2**30
    assert results[0][0].mode == "two_pass" and results[0][0].kept_bytes == 0
    for one, two in zip(results["1GiB"][1], results[0][1]):  # the same step (same noise), up to rounding
        np.testing.assert_allclose(one, two, rtol=1e-5, atol=1e-6)


def test_the_engine_is_built_before_the_step_is_traced():
    """DPModel builds its engine just before the train step is traced (EinsumDense layouts included)."""
    from sparta_tf import DPModel

    model = _mha_model()
    dp_model = DPModel(model, clip_norm=1.0, noise_multiplier=0.0, sample_rate=0.5, dataset_size=8, seed=1)
    dp_model.compile(tf.keras.optimizers.SGD(0.1), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy() for v in model.trainable_variables]
    dp_model.train_on_batch(tf.random.normal([4, 5, 8]), tf.constant([0, 1, 2, 0]), sample_weight=tf.ones([4]))
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
    assert {"ghost", "direct"} & {row.method for row in dp_model.engine_cost_table()}


def test_a_sequence_length_unknown_when_traced_uses_the_exact_direct_norm():
    inputs = tf.keras.Input((None, 6))
    model = tf.keras.Model(inputs, L.Dense(3)(L.GlobalAveragePooling1D()(L.Dense(4)(inputs))))
    x, y = tf.random.normal([5, 7, 6]), tf.constant([0, 1, 2, 0, 1])
    engine = make_engine(model, model.trainable_variables)
    step = tf.function(lambda x: engine.clipped_sum(x, y, loss_fn, tf.ones([5], bool), 0.5).sums,
                       input_signature=[tf.TensorSpec([None, None, 6])])
    reference = make_engine(model, model.trainable_variables, "layerwise")
    for a, b in zip(step(x), clipped_batch(reference, x, y, loss_fn, tf.ones([5], bool), 0.5).sums):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
    assert "direct" in {row.method for row in engine.cost_table()}


def _cancelling_positions(batch=400, features=64, seed=0):
    """``a, d: [B, 2, features]`` whose two positions nearly cancel in ``g_i = sum_t a_t d_t^T``:
    ``a_2 = a_1`` and ``d_2 = -(1 - e_i) d_1`` with ``e_i`` from 1e-6 to 1e-2 (so ``||g_i||`` is
    ``e_i`` times what each position alone contributes)."""
    rng = np.random.default_rng(seed)
    a1 = rng.normal(size=(batch, 1, features)).astype(np.float32)
    d1 = rng.normal(size=(batch, 1, features)).astype(np.float32)
    e = (10.0 ** rng.uniform(-6, -2, size=(batch, 1, 1))).astype(np.float32)
    a = np.concatenate([a1, a1], axis=1)
    d = np.concatenate([d1, -(1 - e) * d1], axis=1).astype(np.float32)
    exact = np.einsum("btk,btl->bkl", a.astype(np.float64), d.astype(np.float64))  # from the same float32 inputs
    return a, d, np.sum(exact ** 2, axis=(1, 2))


def test_the_ghost_norm_never_falls_below_the_exact_norm_when_positions_cancel():
    """Regression: the Gram form summed cancelling float32 terms to zero, a negative number or a
    small fraction of ||g_i||^2, so such an example escaped clipping (on these 400 examples: 212
    below the exact norm, 109 of them negative and 25 exactly zero)."""
    a, d, exact = _cancelling_positions()
    ghost = ghost_norms.linear_squared_norms(tf.constant(a), tf.constant(d), "ghost").numpy().astype(np.float64)
    assert np.all(ghost >= exact), f"{np.sum(ghost < exact)} of {len(exact)} ghost norms below the exact one"
    same = tf.ones([len(exact), 2, 2])  # the embedding rule's index-equality Gram (one index twice)
    embedding = ghost_norms.gram_squared_norms(same, tf.matmul(d, d, transpose_b=True), 4 + d.shape[-1]).numpy()
    exact_embedding = np.sum(np.sum(d.astype(np.float64), axis=1) ** 2, axis=1)
    assert np.all(embedding.astype(np.float64) >= exact_embedding)


def test_the_ghost_norms_rounding_margin_costs_ordinary_examples_little():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(64, 16, 32)).astype(np.float32)
    d = rng.normal(size=(64, 16, 8)).astype(np.float32)
    ghost = ghost_norms.linear_squared_norms(tf.constant(a), tf.constant(d), "ghost").numpy()
    direct = ghost_norms.linear_squared_norms(tf.constant(a), tf.constant(d), "direct").numpy()
    assert np.all(ghost >= direct) and np.all(ghost <= direct * 1.001)


def test_a_dp_step_turns_tensor_float_32_off_so_the_rounding_margin_holds():
    """The margin assumes IEEE float32 matmuls; TF32 (TensorFlow's default on Ampere+ GPUs) rounds
    matmul inputs to 10 mantissa bits. Tracing a DP step must turn it off, even when re-enabled."""
    from sparta_tf import DPModel

    tf.config.experimental.enable_tensor_float_32_execution(True)
    try:
        dp_model = DPModel(MODELS["dense_2d"](), clip_norm=1.0, noise_multiplier=1.0, sample_rate=0.5,
                           dataset_size=8, seed=1)
        dp_model.compile(tf.keras.optimizers.SGD(0.1),
                         loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        assert tf.config.experimental.tensor_float_32_execution_enabled()
        dp_model.train_on_batch(tf.random.normal([4, 6]), tf.constant([0, 1, 2, 0]), sample_weight=tf.ones([4]))
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(False)


def test_a_kernel_shared_by_two_layers_is_clipped_on_the_sum_of_its_parts():
    """Regression: with a kernel owned by two layers (tied weights), the book-keeping engine added
    the layers' squared norms, ||g_A||^2 + ||g_B||^2, and clipped the example at sqrt(2) C."""

    class TiedDense(L.Layer):
        def __init__(self, kernel):
            super().__init__()
            self.kernel = kernel

        def call(self, x):
            return tf.matmul(x, self.kernel)

    inputs = tf.keras.Input((6,))
    dense = L.Dense(3, use_bias=False)
    hidden = dense(inputs)
    model = tf.keras.Model(inputs, L.Add()([hidden, TiedDense(dense.kernel)(inputs)]))
    assert len(model.trainable_variables) == 1
    x, y = 10.0 * tf.random.normal([4, 6], seed=7), tf.constant([0, 1, 2, 0])
    engine = make_engine(model, model.trainable_variables)
    assert not isinstance(engine, BookkeepingEngine)
    with pytest.raises(ValueError, match="tied weights"):
        make_engine(model, model.trainable_variables, "bookkeeping")
    for i in range(4):
        only = tf.one_hot(i, 4) > 0
        (total,) = clipped_batch(engine, x, y, loss_fn, only, 0.01).sums
        assert float(tf.norm(total)) <= 0.01 * (1 + 1e-5)
