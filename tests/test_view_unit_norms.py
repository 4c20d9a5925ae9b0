"""Augmentation multiplicity in the book-keeping engine: an example's K view rows are one unit.

The unit's gradient is the sum of its rows' gradients (of the views' mean loss), clipped once. For
linear maps (Dense on 2-D and 3-D input, EinsumDense, Embedding, Conv1D, Conv2D) its norm is the
ghost or direct norm over the unit's merged positions (:mod:`sparta_tf.per_example.units`); other
variables' per-row gradients are summed per unit. Checked against every example's gradient taken
alone with ``tf.GradientTape`` (each view alone, float64, averaged over the views, clipped, summed):

* per-unit squared norms (never below the exact ones) and clipped sums, whole variables and rows
  selections (SPARTA's sparse phase) and entries, one pass and two passes, K = 2 and 3, with padding;
* both norm methods (ghost and direct) are exact per unit;
* an example with a non-finite view, or padding, contributes exactly zero; an example whose norm
  overflows is dropped without touching the others; each example contributes at most ``C``;
* the cost table names the per-unit methods (``ghost_views``), and a Dense step never forms
  per-example kernel gradients;
* the selection statistics (SPARTA's scores) equal the materialising engine's with views.
"""

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf import trainable as trainable_lib
from sparta_tf.backend import variable_key
from sparta_tf.groups import row_groups
from sparta_tf.per_example import make_engine
from sparta_tf.per_example.bookkeeping import BookkeepingEngine
from sparta_tf.per_example.rules import ghost_norms
from sparta_tf.privacy.mechanism import DpSgdMechanism

L = tf.keras.layers
B = 4  # examples per batch (the last one padding where a test asks)
CLASSES = 3


def loss_fn(y, logits):
    return tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _head(h):
    return L.Dense(CLASSES, name="head")(L.Flatten()(h))


def _on(shape, body, dtype=tf.float32):
    inputs = tf.keras.Input(shape, dtype=dtype)
    return tf.keras.Model(inputs, _head(body(inputs)))


def _mlp():
    return tf.keras.Sequential([tf.keras.Input((6,)), L.Dense(8, activation="relu"), L.Dense(8), L.ReLU(),
                                L.Dense(CLASSES, name="head")])


def _resnet_gn():
    """A ResNet-like block: conv, GroupNorm, ReLU, conv, GroupNorm, the shortcut, pooling, head."""
    inputs = tf.keras.Input((6, 6, 3))
    h = L.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    h = L.ReLU()(L.GroupNormalization(2)(h))
    shortcut = h
    h = L.ReLU()(L.GroupNormalization(2)(L.Conv2D(4, 3, padding="same", use_bias=False)(h)))
    h = L.Conv2D(4, 3, padding="same", use_bias=False)(h)
    h = L.ReLU()(L.GroupNormalization(2)(h) + shortcut)
    return tf.keras.Model(inputs, L.Dense(CLASSES, name="head")(L.GlobalAveragePooling2D()(h)))


MODELS = {
    "dense_2d": lambda: tf.keras.Sequential([tf.keras.Input((6,)), L.Dense(5), L.Dense(CLASSES)]),
    "dense_3d": lambda: _on((4, 6), L.Dense(5)),
    "einsum_dense": lambda: _on((4, 6), L.EinsumDense("abc,cd->abd", output_shape=(4, 5), bias_axes="d")),
    "embedding": lambda: _on((5,), L.Embedding(7, 4), tf.int32),
    "conv1d": lambda: _on((5, 3), L.Conv1D(4, 3, padding="same")),
    "conv2d_same": lambda: _on((6, 6, 3), L.Conv2D(4, 3, padding="same")),
    "conv2d_valid_stride": lambda: _on((7, 7, 3), L.Conv2D(4, 3, strides=2, padding="valid")),
    "mlp": _mlp,
    "resnet_gn": _resnet_gn,
}


def _batch(model, views: int, seed: int = 0):
    """``(rows [K B, ...], labels [K B], valid [B])``: ``B`` examples, ``K`` distinct views each
    (row ``i K + k``: view ``k`` of example ``i``), the last example padding."""
    rng = np.random.default_rng(seed)
    shape = (B * views, *model.inputs[0].shape[1:])
    if model.inputs[0].dtype == tf.int32:
        x = tf.constant(rng.integers(0, 7, size=shape), tf.int32)
    else:
        x = tf.constant(rng.normal(size=shape), tf.float32)
    y = tf.constant(np.repeat(rng.integers(0, CLASSES, B), views), tf.int32)
    return x, y, tf.constant([True] * (B - 1) + [False])


def _selections(model, kind: str):
    """Every variable whole, or rows 0 and last of every row group (the others whole), or every
    other entry of every kernel."""
    groups = {variable_key(g.variable): g for g in row_groups(model)}
    selections = []
    for variable in model.trainable_variables:
        group = groups.get(variable_key(variable))
        if kind == "rows" and group is not None and group.n_rows > 2:
            selections.append(trainable_lib.rows(group, [0, group.n_rows - 1]))
        elif kind == "entries" and "kernel" in variable.name and variable.shape.num_elements() > 1:
            mask = (np.arange(variable.shape.num_elements()) % 2 == 0).reshape(variable.shape)
            selections.append(trainable_lib.entries(variable, mask))
        else:
            selections.append(trainable_lib.dense(variable))
    return selections


def reference_unit_gradients(model, selections, x, y, valid, views: int) -> list[list[np.ndarray]]:
    """Per real example: ``(1/K) sum_k`` of each view's gradient taken alone (float64), compact."""
    variables = [s.variable for s in selections]
    per_example = []
    for i in np.flatnonzero(valid.numpy()):
        total = None
        for k in range(views):
            row = i * views + k
            with tf.GradientTape() as tape:
                loss = loss_fn(y[row : row + 1], model(x[row : row + 1], training=True))[0]
            grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            grads = [np.asarray(s.compact(tf.convert_to_tensor(g)), np.float64) / views
                     for s, g in zip(selections, grads)]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        per_example.append(total)
    return per_example


def _squared_norms(per_example) -> np.ndarray:
    return np.array([sum(float(np.sum(g * g)) for g in grads) for grads in per_example])


def _clipped_sum(per_example, clip_norm: float) -> list[np.ndarray]:
    factors = np.minimum(1.0, clip_norm / np.sqrt(_squared_norms(per_example)))
    return [sum(f * grads[k] for f, grads in zip(factors, per_example)) for k in range(len(per_example[0]))]


def _engine(model, selections, views: int, max_memory=None) -> BookkeepingEngine:
    engine = make_engine(model, selections, "auto", views=views, max_memory=max_memory)
    assert isinstance(engine, BookkeepingEngine)
    return engine


def _assert_exact(model, selections, views: int, max_memory=None, margin: float = 1e-4, seed: int = 0):
    """Our per-unit squared norms and clipped sums (two clip norms: most examples clipped, none)
    against the one-example reference; returns the engine. ``margin``: how far above the exact
    squared norms ours may lie, the ghost norm's rounding bound (``gram_squared_norms``: up to
    ``2 gamma_n T``, e.g. 3.6e-5 for a head on 144 inputs, ``T = 2`` views, ``n = 2T + 144 + 3``)."""
    x, y, valid = _batch(model, views, seed)
    engine = _engine(model, selections, views, max_memory)
    step = tf.function(lambda clip_norm: engine.clipped_sum(x, y, loss_fn, valid, clip_norm))
    reference = reference_unit_gradients(model, selections, x, y, valid, views)
    exact = _squared_norms(reference)
    for clip_norm in (float(np.sqrt(np.median(exact))), 1e3):
        ours = step(tf.constant(clip_norm, tf.float32))
        norms = ours.squared_norms.numpy()[valid.numpy()]
        assert np.all(norms >= exact * (1 - 1e-5)), (norms, exact)  # never below: never clipped too little
        np.testing.assert_allclose(norms, exact, rtol=1e-5 + margin)
        expected = _clipped_sum(reference, clip_norm)
        scale = max(float(np.max(np.abs(e))) for e in expected) + 1e-12
        for selection, a, b in zip(selections, ours.sums, expected):
            assert a.shape == b.shape, variable_key(selection.variable)
            np.testing.assert_allclose(a.numpy() / scale, b / scale, atol=1e-5 + margin,
                                       err_msg=f"{variable_key(selection.variable)} C={clip_norm:.3g}")
    return engine


@pytest.mark.parametrize("kind", ["whole", "rows"])
@pytest.mark.parametrize("views", [2, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_unit_norms_and_clipped_sums_equal_the_one_example_reference(name, views, kind):
    tf.keras.utils.set_random_seed(1)
    model = MODELS[name]()
    engine = _assert_exact(model, _selections(model, kind), views)
    methods = {row.method for row in engine.cost_table()}
    assert all(method.endswith("_views") for method in methods), methods


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_two_pass_step_is_exact_per_unit(name):
    tf.keras.utils.set_random_seed(2)
    model = MODELS[name]()
    engine = _assert_exact(model, _selections(model, "rows"), 2, max_memory=0)
    assert engine.memory_plan().mode == "two_pass"
    assert "streamed" in {row.output_gradient for row in engine.cost_table()}


@pytest.mark.parametrize("name", ["dense_3d", "einsum_dense", "conv2d_same", "mlp"])
def test_entries_selections_are_exact_per_unit(name):
    tf.keras.utils.set_random_seed(3)
    model = MODELS[name]()
    _assert_exact(model, _selections(model, "entries"), 2)


@pytest.mark.parametrize("method", ["ghost", "direct"])
@pytest.mark.parametrize("name", ["dense_2d", "dense_3d", "einsum_dense", "conv1d", "conv2d_same",
                                  "conv2d_valid_stride"])
def test_ghost_norm_and_direct_norm_are_both_exact_per_unit(name, method, monkeypatch):
    monkeypatch.setattr(ghost_norms, "choose_linear_norm",
                        lambda t, d, p: ("rank_one", None, 0) if t == 1 else (method, 1, 1))
    tf.keras.utils.set_random_seed(4)
    model = MODELS[name]()
    # the ghost norm's rounding margin: at most 2 gamma_n T of the squared norm (n = 2T + d + p;
    # T = 2 x 36 positions for conv2d_same)
    engine = _assert_exact(model, _selections(model, "rows"), 2, margin=2e-3 if method == "ghost" else 0.0)
    assert f"{method}_views" in {row.method for row in engine.cost_table()}


def test_a_sequence_length_unknown_when_traced_takes_the_exact_direct_norm_per_unit():
    tf.keras.utils.set_random_seed(11)
    model = tf.keras.Sequential([tf.keras.Input((None, 6)), L.Dense(5), L.GlobalAveragePooling1D(), L.Dense(CLASSES)])
    views = 2
    x = tf.random.normal([B * views, 4, 6])
    y, valid = tf.constant(np.repeat([0, 1, 2, 0], views), tf.int32), tf.ones([B], bool)
    engine = _engine(model, model.trainable_variables, views)
    step = tf.function(lambda x: engine.clipped_sum(x, y, loss_fn, valid, 1e3),
                       input_signature=[tf.TensorSpec([None, None, 6], tf.float32)])
    ours = step(x)
    reference = reference_unit_gradients(model, [trainable_lib.dense(v) for v in model.trainable_variables],
                                         x, y, valid, views)
    np.testing.assert_allclose(ours.squared_norms.numpy(), _squared_norms(reference), rtol=1e-5)
    assert {row.method for row in engine.cost_table() if row.layer == model.layers[0].name} == \
        {"direct_views", "elementwise_views"}


def test_the_cost_table_names_the_per_unit_methods():
    tf.keras.utils.set_random_seed(5)
    model = tf.keras.Sequential([tf.keras.Input((5,), dtype=tf.int32), L.Embedding(7, 4), L.Flatten(),
                                 L.Dense(64, activation="relu"), L.Dense(64), L.GroupNormalization(4),
                                 L.Dense(CLASSES, name="head")])
    x, y, valid = _batch(model, 2)
    engine = _engine(model, model.trainable_variables, 2)
    tf.function(lambda: engine.clipped_sum(x, y, loss_fn, valid, 1.0).sums)()
    methods = {(row.layer, row.variable.split("/")[-1].split(":")[0]): row.method for row in engine.cost_table()}
    dense = model.layers[2].name
    assert methods[(dense, "kernel")] == "ghost_views"  # 2^2 (20 + 64) < 2 x 20 x 64
    assert methods[(dense, "bias")] == "elementwise_views"
    assert methods[(model.layers[0].name, "embeddings")] == "index_equality_views"
    assert methods[(model.layers[4].name, "gamma")] == "elementwise_views"
    assert methods[("head", "kernel")] == "ghost_views"
    assert "direct_views" not in methods.values()


def _kernel_sized_tensors(graph, leading: set, kernels):
    sizes = {n * int(np.prod(k)) for n in leading for k in kernels}
    return [(op.type, op.name, out.shape) for op in graph.get_operations() for out in op.outputs
            if out.shape.rank and out.shape.is_fully_defined() and out.shape[0] in leading
            and out.shape.num_elements() in sizes]


def test_a_dense_step_with_views_never_materialises_per_example_kernel_gradients():
    tf.keras.utils.set_random_seed(6)
    model = tf.keras.Sequential([tf.keras.Input((33,)), L.Dense(40, activation="relu"), L.Dense(37), L.Dense(5)])
    batch, views = 7, 2
    x, y = tf.random.normal([batch * views, 33]), tf.zeros([batch * views], tf.int32)
    kernels = [v.shape for v in model.trainable_variables if "kernel" in v.name]
    graphs = []
    for engine in (_engine(model, model.trainable_variables, views),
                   make_engine(model, model.trainable_variables, "layerwise", views=views)):
        step = tf.function(lambda: _statistic(engine, x, y, tf.ones([batch], bool)))
        graphs.append(step.get_concrete_function().graph)
    assert _kernel_sized_tensors(graphs[0], {batch, batch * views}, kernels) == []
    assert _kernel_sized_tensors(graphs[1], {batch, batch * views}, kernels)  # the check can fail


def _statistic(engine, x, y, valid):
    from sparta_tf.per_example.bookkeeping import clipped_batch

    return clipped_batch(engine, x, y, loss_fn, valid, 1.0).sums


@pytest.mark.parametrize("max_memory", [None, 0], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("name", ["mlp", "conv2d_same", "embedding"])
def test_padding_and_an_example_with_a_non_finite_view_contribute_exactly_zero(name, max_memory):
    tf.keras.utils.set_random_seed(7)
    model = MODELS[name]()
    views = 2
    x, y, _ = _batch(model, views)
    engine = _engine(model, _selections(model, "rows"), views, max_memory)
    step = tf.function(lambda x, valid: engine.clipped_sum(x, y, loss_fn, valid, 0.5))
    base = step(x, tf.constant([True, False, True, False]))
    if x.dtype.is_floating:  # example 1: one view infinite, one NaN (real); example 3: NaN padding
        poisoned = tf.tensor_scatter_nd_update(x, [[2], [3], [6], [7]], tf.stack(
            [tf.fill(x.shape[1:], np.inf), tf.fill(x.shape[1:], np.nan)] * 2))
        ours = step(poisoned, tf.constant([True, True, True, False]))
    else:  # token ids cannot be non-finite: padding only, with other ids
        ours = step(tf.tensor_scatter_nd_update(x, [[6], [7]], tf.fill([2, *x.shape[1:]], 3)),
                    tf.constant([True, False, True, False]))
    for a, b in zip(base.sums, ours.sums):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # bit-identical: nothing leaks


@pytest.mark.parametrize("max_memory", [None, 0], ids=["one_pass", "two_pass"])
def test_an_example_whose_norm_overflows_is_dropped_without_touching_the_others(max_memory):
    tf.keras.utils.set_random_seed(8)
    model = MODELS["conv2d_same"]()
    views = 2
    x, y, _ = _batch(model, views)
    engine = _engine(model, _selections(model, "whole"), views, max_memory)
    step = tf.function(lambda x, valid: engine.clipped_sum(x, y, loss_fn, valid, 1.0).sums)
    huge = tf.tensor_scatter_nd_update(x, [[3]], [tf.fill(x.shape[1:], 3e38)])  # example 1's second view
    without = step(x, tf.constant([True, False, True, True]))
    for a, b in zip(without, step(huge, tf.ones([B], bool))):
        assert np.all(np.isfinite(b.numpy()))
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("max_memory", [None, 0], ids=["one_pass", "two_pass"])
def test_every_example_contributes_at_most_the_clip_norm(max_memory):
    tf.keras.utils.set_random_seed(9)
    model = MODELS["dense_3d"]()
    views = 3
    x, _, _ = _batch(model, views)
    x = 100.0 * x
    y = tf.argmin(model(x), axis=-1, output_type=tf.int32)  # the least likely class: a large gradient
    engine = _engine(model, model.trainable_variables, views, max_memory)
    for i in range(B):
        only = tf.one_hot(i, B) > 0
        sums = engine.clipped_sum(x, y, loss_fn, only, 0.25).sums
        norm = np.sqrt(sum(float(tf.reduce_sum(tf.square(s))) for s in sums))
        assert 0.2 < norm <= 0.25 * (1 + 1e-6)


@pytest.mark.parametrize("score, granularity", [("sum_abs", "row"), ("oracle", "row"), ("abs_sum", "row"),
                                                ("signed", "entry")])
@pytest.mark.parametrize("name", ["dense_2d", "conv2d_same"])
def test_selection_statistics_with_views_equal_the_materialising_engine(name, score, granularity):
    from sparta_tf.selection.scoring import SelectionScorer

    tf.keras.utils.set_random_seed(10)
    model = MODELS[name]()
    views = 2
    scorer = SelectionScorer(row_groups(model), DpSgdMechanism(1.0, 1.0, clip_norm=0.05), score=score,
                             granularity=granularity)
    x, y, valid = _batch(model, views)
    engine = _engine(model, scorer.selections, views)
    ours = tf.function(lambda: scorer.batch_statistic_bookkeeping(engine, x, y, loss_fn, valid)[0])()
    reference = make_engine(model, scorer.selections, "layerwise", views=views)
    theirs = tf.function(lambda: scorer.batch_statistic(reference(x, y, loss_fn, valid).grads, valid))()
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6 * float(np.max(np.abs(b))))
