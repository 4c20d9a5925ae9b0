"""Row groups, compact per-example gradients, the masked optimizer and the LR schedule."""

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf import groups, trainable
from sparta_tf.backend import depthwise_kernel
from sparta_tf.optim import MaskedOptimizer, cosine_with_warmup
from sparta_tf.per_example import LayerwiseEngine, VectorizedEngine, make_engine
from sparta_tf.per_example.rules.conv2d import DEPTHWISE_MAX_ROWS
from sparta_tf.trainable import TrainableSet
from small_models import per_example_loss, tape_gradients
from small_models import variable_name as _key

L = tf.keras.layers


# ============================================================================ groups

# (layer factory, input shape without batch, kernel shape, output axes, n_rows, row_size)
ROW_GROUP_CASES = {
    "dense": (lambda: L.Dense(7, use_bias=False, name="layer"), (5,), (5, 7), (1,), 7, 5),
    "conv2d": (lambda: L.Conv2D(6, (3, 2), use_bias=False, name="layer"), (5, 5, 4), (3, 2, 4, 6), (3,), 6, 24),
    "depthwise": (
        lambda: L.DepthwiseConv2D(3, depth_multiplier=2, padding="same", use_bias=False, name="layer"),
        (5, 5, 4), (3, 3, 4, 2), (2, 3), 8, 9,
    ),
    "einsum_trailing": (
        lambda: L.EinsumDense("abc,cde->abde", output_shape=(2, 3, 4), name="layer"),
        (2, 5), (5, 3, 4), (1, 2), 12, 5,
    ),
    "einsum_non_trailing": (
        lambda: L.EinsumDense("abc,dce->abde", output_shape=(2, 3, 4), name="layer"),
        (2, 5), (3, 5, 4), (0, 2), 12, 5,
    ),
}


def _kernel(layer):
    return depthwise_kernel(layer) if isinstance(layer, L.DepthwiseConv2D) else layer.kernel


def _model_around(layer_factory, input_shape):
    tf.keras.utils.set_random_seed(0)
    layer = layer_factory()
    inputs = L.Input(input_shape)
    outputs = L.Dense(2, name="head")(L.Flatten()(layer(inputs)))
    return tf.keras.Model(inputs, outputs), layer


@pytest.mark.parametrize("case", sorted(ROW_GROUP_CASES))
def test_row_group_structure_and_row_view(case):
    factory, input_shape, kernel_shape, axes, n_rows, row_size = ROW_GROUP_CASES[case]
    model, layer = _model_around(factory, input_shape)
    found = groups.row_groups(model)
    assert len(found) == 1, "the head must not be a row group"
    group = found[0]
    assert group.layer == "layer" and group.variable is _kernel(layer)
    assert group.shape == kernel_shape
    assert group.output_axes == axes
    assert (group.n_rows, group.row_size) == (n_rows, row_size)

    w = np.random.default_rng(1).normal(size=kernel_shape).astype(np.float32)
    view = group.to_row_view(tf.constant(w)).numpy()
    input_axes = tuple(a for a in range(len(kernel_shape)) if a not in axes)
    np.testing.assert_array_equal(view, w.transpose(input_axes + axes).reshape(row_size, n_rows))
    for j in (0, n_rows // 2, n_rows - 1):
        np.testing.assert_array_equal(view[:, j], w.reshape(-1)[group.row_flat_indices([j])])
    # Several rows: positions line up with a [fan_in, k] block flattened row-major.
    picked = [n_rows - 1, 0, 2]
    block = w.reshape(-1)[group.row_flat_indices(picked)].reshape(row_size, len(picked))
    np.testing.assert_array_equal(block, view[:, picked])
    # Batched row view.
    stacked = np.stack([w, 2 * w])
    batched = group.to_row_view(tf.constant(stacked), batch_dims=1).numpy()
    np.testing.assert_array_equal(batched, np.stack([view, 2 * view]))


@pytest.mark.parametrize("case", sorted(ROW_GROUP_CASES))
def test_a_row_is_exactly_one_output_unit(case):
    """Non-zero weights only on row j's coordinates: only output unit j responds."""
    factory, input_shape, _, _, n_rows, _ = ROW_GROUP_CASES[case]
    model, layer = _model_around(factory, input_shape)
    group = groups.row_groups(model)[0]
    x = tf.random.stateless_normal((2, *input_shape), seed=(3, 4))
    rng = np.random.default_rng(2)
    for j in (0, 1, n_rows - 1):
        w = np.zeros(group.shape, np.float32)
        flat = w.reshape(-1)
        idx = group.row_flat_indices([j])
        flat[idx] = rng.uniform(0.5, 1.5, size=idx.size)
        _kernel(layer).assign(w)
        y = layer(x).numpy().reshape(2, -1, n_rows)  # output units flattened last
        others = np.delete(y, j, axis=-1)
        assert np.all(others == 0), f"row {j} leaks into other output units"
        assert np.any(y[..., j] != 0), f"row {j} does not drive output unit {j}"


def test_parameter_roles_and_head_detection():
    tf.keras.utils.set_random_seed(0)
    inputs = L.Input((6,), dtype="int32")
    h = L.Embedding(10, 8, name="emb")(inputs)
    h = L.Dense(8, name="proj")(h)
    h = L.LayerNormalization(name="ln")(h)
    h = L.GroupNormalization(2, name="gn")(h)
    h = L.Conv1D(4, 3, name="conv1d")(h)
    h = L.GlobalAveragePooling1D()(h)
    model = tf.keras.Model(inputs, L.Dense(3, name="classifier")(h))

    assert groups.find_head(model).name == "classifier"  # no "head": the last Dense
    roles = {_key(p.variable): p.role for p in groups.parameter_table(model)}
    assert roles == {
        "emb/embeddings": "other",
        "proj/kernel": "kernel",
        "proj/bias": "bias",
        "ln/gamma": "norm",
        "ln/beta": "norm",
        "gn/gamma": "norm",
        "gn/beta": "norm",
        "conv1d/kernel": "kernel",
        "conv1d/bias": "bias",
        "classifier/kernel": "head",
        "classifier/bias": "head",
    }
    assert [g.layer for g in groups.row_groups(model)] == ["proj", "conv1d"]
    conv1d = groups.row_groups(model)[1]
    assert (conv1d.output_axes, conv1d.n_rows, conv1d.row_size) == ((2,), 4, 24)

    # An explicit head (by name) overrides the default.
    by_name = {_key(p.variable): p.role for p in groups.parameter_table(model, head="proj")}
    assert by_name["proj/kernel"] == "head" and by_name["classifier/kernel"] == "kernel"
    assert [g.layer for g in groups.row_groups(model, head="proj")] == ["conv1d", "classifier"]


def test_layer_named_head_wins_over_the_last_dense():
    tf.keras.utils.set_random_seed(0)
    inputs = L.Input((4,))
    h = L.Dense(5, name="head")(inputs)
    model = tf.keras.Model(inputs, L.Dense(3, name="after")(h))
    assert groups.find_head(model).name == "head"
    roles = {_key(p.variable): p.role for p in groups.parameter_table(model)}
    assert roles == {"head/kernel": "head", "head/bias": "head", "after/kernel": "kernel", "after/bias": "bias"}
    assert [g.layer for g in groups.row_groups(model)] == ["after"]


def test_conv1d_transpose_rows_are_not_its_input_channels():
    """Regression: Conv1DTranspose subclasses Conv1D; its kernel [k, filters, in] has the input channels last."""
    tf.keras.utils.set_random_seed(0)
    inputs = L.Input((7, 4))
    h = L.Conv1DTranspose(5, 3, name="tconv")(inputs)
    model = tf.keras.Model(inputs, L.Dense(2, name="head")(L.Flatten()(h)))
    table = {p.layer: p for p in groups.parameter_table(model) if _key(p.variable) == "tconv/kernel"}
    info = table["tconv"]
    # Either excluded like Conv2DTranspose ("other"), or rows are its 5 output channels (kernel axis 1).
    assert info.role == "other" or (info.group.output_axes == (1,) and info.group.n_rows == 5)


# ============================================================ compact per-example grads


def conv_model():
    """Convs: 3x3 s1 same, 3x3 s2 valid (unused last pixel), 3x3 s1 valid, 3x3 s2 same (asymmetric pad)."""
    tf.keras.utils.set_random_seed(0)
    inputs = L.Input((14, 14, 3))
    h = L.Conv2D(6, 3, padding="same", activation="relu", name="c_s1_same")(inputs)
    h = L.GroupNormalization(2, name="gn")(h)
    h = L.Conv2D(8, 3, strides=2, padding="valid", activation="relu", name="c_s2_valid")(h)  # 14 -> 6
    h = L.Conv2D(7, 3, padding="valid", activation="relu", name="c_s1_valid")(h)  # 6 -> 4
    h = L.Conv2D(6, 3, strides=2, padding="same", name="c_s2_same")(h)  # 4 -> 2, pad (0, 1)
    h = L.GlobalAveragePooling2D()(h)
    h = L.Activation("tanh")(L.Dense(5, name="fc")(h))
    return tf.keras.Model(inputs, L.Dense(3, name="head")(h))


FEW = "few"  # <= DEPTHWISE_MAX_ROWS rows: depthwise-correlation path
MANY = "many"  # > DEPTHWISE_MAX_ROWS rows: im2col path

# kind per conv layer (and per other variable) in each configuration.
SELECTION_CONFIGS = {
    "a": {"c_s1_same": FEW, "c_s2_valid": MANY, "c_s1_valid": "entries", "c_s2_same": "exactly_max",
          "fc": "rows", "biases": "entries", "gn": "dense"},
    "b": {"c_s1_same": MANY, "c_s2_valid": FEW, "c_s1_valid": "exactly_max", "c_s2_same": "entries",
          "fc": "entries", "biases": "dense", "gn": "entries"},
    "c": {"c_s1_same": "entries", "c_s2_valid": "exactly_max", "c_s1_valid": MANY, "c_s2_same": FEW,
          "fc": "dense", "biases": "entries", "gn": "entries"},
}


def _pick_rows(n_rows, how, rng):
    count = {FEW: 2, "exactly_max": DEPTHWISE_MAX_ROWS, MANY: DEPTHWISE_MAX_ROWS + 1}[how]
    assert count < n_rows
    return np.sort(rng.choice(n_rows, count, replace=False))


def _random_mask(variable, rng):
    mask = rng.random(variable.shape.as_list()) < 0.4
    mask.reshape(-1)[0] = True
    mask.reshape(-1)[-1] = False
    return mask


def build_selections(model, config):
    rng = np.random.default_rng(sum(map(ord, config)))
    spec = SELECTION_CONFIGS[config]
    row_groups = {g.layer: g for g in groups.row_groups(model)}
    selections = []
    few_rows = 0
    for layer in model.layers:
        name = layer.name
        if name in row_groups:
            group, how = row_groups[name], spec[name]
            if how == "entries":
                sel = trainable.entries(group.variable, _random_mask(group.variable, rng))
            elif how == "dense":
                sel = trainable.dense(group.variable)
            else:
                sel = trainable.rows(group, _pick_rows(group.n_rows, FEW if how == "rows" else how, rng))
                assert sel.kind == "rows"
                if isinstance(layer, L.Conv2D) and how in (FEW, "exactly_max"):
                    few_rows += len(sel.rows)
            selections.append(sel)
            if layer.bias is not None:
                bias = layer.bias
                selections.append(
                    trainable.entries(bias, _random_mask(bias, rng)) if spec["biases"] == "entries" else trainable.dense(bias)
                )
        elif name == "gn":
            for v in (layer.gamma, layer.beta):
                selections.append(trainable.entries(v, _random_mask(v, rng)) if spec["gn"] == "entries" else trainable.dense(v))
        elif name == "head":
            selections += [trainable.dense(layer.kernel), trainable.dense(layer.bias)]
    assert all(s is not None for s in selections)
    return TrainableSet(selections), few_rows


def full_per_example_grads(model, x, y):
    """:func:`small_models.tape_gradients` keyed by ``id(variable)``."""
    return dict(zip(map(id, model.trainable_variables), tape_gradients(model, x, y)))


@pytest.fixture(scope="module")
def conv_setup():
    model = conv_model()
    x = tf.random.stateless_normal([4, 14, 14, 3], seed=(7, 8))
    y = tf.constant([0, 2, 1, 2])
    return model, x, y, full_per_example_grads(model, x, y)


@pytest.mark.parametrize("config", sorted(SELECTION_CONFIGS))
def test_compact_per_example_grads_match_per_example_tape(conv_setup, config):
    model, x, y, full = conv_setup
    tset, few_rows = build_selections(model, config)
    kinds = {s.kind for s in tset}
    assert kinds == {"dense", "rows", "entries"}

    want = [s.compact(tf.constant(full[id(s.variable)]), batch_dims=1).numpy() for s in tset]
    assert any(np.abs(w).max() > 1e-3 for w in want)

    layerwise = make_engine(model, tset, "layerwise")
    assert isinstance(layerwise, LayerwiseEngine)
    fn = tf.function(lambda: layerwise(x, y, per_example_loss, tf.ones([4], bool)))
    result = fn()
    assert len(result.grads) == len(tset)
    for s, got, w in zip(tset, result.grads, want):
        assert tuple(got.shape) == (4, *s.compact_shape), s.variable.name
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-5, err_msg=f"{s.variable.name} ({s.kind})")
    # The few-rows path really runs: one depthwise correlation per selected row of such convs.
    ops = [op.type for op in fn.get_concrete_function().graph.get_operations()]
    assert ops.count("DepthwiseConv2dNative") == few_rows > 0

    vectorized = make_engine(model, tset, "vectorized")
    assert isinstance(vectorized, VectorizedEngine)
    vec = vectorized(x, y, per_example_loss, tf.ones([4], bool))
    for s, got, w in zip(tset, vec.grads, want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-5, err_msg=f"{s.variable.name} ({s.kind})")
    np.testing.assert_allclose(vec.losses.numpy(), result.losses.numpy(), rtol=1e-5)


def test_compact_grads_of_non_trailing_einsum_rows():
    """Rows of an EinsumDense whose output axes are not last (VJP rule + compact)."""
    tf.keras.utils.set_random_seed(0)
    inputs = L.Input((3, 5))
    h = L.EinsumDense("abc,dce->abde", output_shape=(3, 4, 2), name="ein")(inputs)
    model = tf.keras.Model(inputs, L.Dense(3, name="head")(L.Flatten()(h)))
    group = groups.row_groups(model)[0]
    assert group.output_axes == (0, 2)
    tset = TrainableSet([trainable.rows(group, [1, 6])])
    x, y = tf.random.stateless_normal([3, 3, 5], seed=(1, 2)), tf.constant([0, 1, 2])
    want = tset.selections[0].compact(tf.constant(full_per_example_grads(model, x, y)[id(group.variable)]), 1)
    for engine in ("layerwise", "vectorized"):
        got = make_engine(model, tset, engine)(x, y, per_example_loss, tf.ones([3], bool)).grads[0]
        assert got.shape == (3, 5, 2)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


# ==================================================================== masked optimizer

OPTIMIZERS = {
    "sgd_momentum": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "sgd_plain": lambda: tf.keras.optimizers.SGD(0.1),
    "adam": lambda: tf.keras.optimizers.Adam(0.01),
    "sgd_weight_decay": lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.05),
    "adam_weight_decay": lambda: tf.keras.optimizers.Adam(0.01, weight_decay=0.05),
}
SLOTS = {"sgd_momentum": 1, "sgd_nesterov": 1, "sgd_plain": 0, "adam": 2}


def _grad_sequence(shapes, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    return [[tf.constant(rng.normal(size=s).astype(np.float32)) for s in shapes] for _ in range(steps)]


def _keras_reference(factory, initial_values, grad_steps):
    """Keras' own optimizer on fresh variables holding ``initial_values``."""
    variables = [tf.Variable(v) for v in initial_values]
    optimizer = factory()
    for grads in grad_steps:
        optimizer.apply_gradients(zip(grads, variables))
    return [v.numpy() for v in variables]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_dense_trainable_set_matches_keras(name):
    rng = np.random.default_rng(0)
    init = [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)]
    variables = [tf.Variable(v) for v in init]
    grad_steps = _grad_sequence([(4, 3), (3,)])
    optimizer = MaskedOptimizer(OPTIMIZERS[name]())
    optimizer.build(TrainableSet.of_variables(variables))
    for grads in grad_steps:
        optimizer.apply(grads)
    assert int(optimizer.keras_optimizer.iterations.numpy()) == 3
    for got, want in zip(variables, _keras_reference(OPTIMIZERS[name], init, grad_steps)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(variables[0].numpy(), init[0])


def _sparse_setup(seed=0):
    """A Dense-like kernel with a rows selection, a 4-D kernel with an entries selection, a dense bias."""
    rng = np.random.default_rng(seed)
    w = tf.Variable(rng.normal(size=(5, 6)).astype(np.float32), name="w")
    k = tf.Variable(rng.normal(size=(3, 3, 2, 4)).astype(np.float32), name="k")
    b = tf.Variable(rng.normal(size=(6,)).astype(np.float32), name="b")
    group = groups.RowGroup("w_layer", w, (1,), 6, 5)
    mask = rng.random((3, 3, 2, 4)) < 0.3
    selections = [trainable.rows(group, [1, 4]), trainable.entries(k, mask), trainable.dense(b)]
    return TrainableSet(selections), group, mask


@pytest.mark.parametrize("name", ["sgd_momentum", "sgd_nesterov", "sgd_plain", "adam"])
def test_sparse_selections_touch_only_trainable_coordinates(name):
    tset, _, mask = _sparse_setup()
    rows_sel, entries_sel, _ = tset.selections
    assert rows_sel.kind == "rows" and entries_sel.kind == "entries"
    initial = [s.variable.numpy().copy() for s in tset]
    grad_steps = _grad_sequence([s.compact_shape for s in tset], steps=4, seed=1)
    optimizer = MaskedOptimizer(OPTIMIZERS[name]())
    optimizer.build(tset)
    assert optimizer.state_size == tset.size * SLOTS[name]
    assert tset.size == 5 * 2 + int(mask.sum()) + 6
    for grads in grad_steps:
        optimizer.apply(grads)

    initial_compact = [s.compact(tf.constant(v)).numpy() for s, v in zip(tset, initial)]
    want = _keras_reference(OPTIMIZERS[name], initial_compact, grad_steps)
    for s, before, w in zip(tset, initial, want):
        after = s.variable.numpy()
        trainable_mask = s.dense_mask()
        assert np.array_equal(after[~trainable_mask], before[~trainable_mask]), f"{s.variable.name} frozen part moved"
        assert not np.any(after[trainable_mask] == before[trainable_mask])
        np.testing.assert_allclose(s.compact(tf.constant(after)).numpy(), w, rtol=1e-6, atol=1e-7)
    # The rows selection trained exactly columns 1 and 4 of the kernel.
    moved = np.any(tset.selections[0].variable.numpy() != initial[0], axis=0)
    assert moved.tolist() == [False, True, False, False, True, False]


def test_rebuild_keeps_state_of_unchanged_selections_and_resets_changed_ones():
    tset, group, mask = _sparse_setup()
    w, k, b = tset.variables
    grad_steps = _grad_sequence([s.compact_shape for s in tset], steps=3, seed=2)
    initial_compact = [s.compact(tf.constant(s.variable.numpy())).numpy() for s in tset]
    factory = OPTIMIZERS["sgd_momentum"]
    optimizer = MaskedOptimizer(factory())
    optimizer.build(tset)
    for grads in grad_steps[:2]:
        optimizer.apply(grads)
    slots_before = {key: [v.numpy().copy() for v in vs] for key, vs in optimizer.slots.items()}
    assert all(np.any(vs[0] != 0) for vs in slots_before.values())

    # Same coordinates, freshly built selection objects: state kept, training continues as Keras would.
    same = TrainableSet([trainable.rows(group, [4, 1]), trainable.entries(k, mask.copy()), trainable.dense(b)])
    optimizer.build(same)
    assert optimizer.slots.keys() == slots_before.keys()
    for key, vs in optimizer.slots.items():
        for got, want in zip(vs, slots_before[key]):
            np.testing.assert_array_equal(got.numpy(), want)
    optimizer.apply(grad_steps[2])
    want = _keras_reference(factory, initial_compact, grad_steps)
    for s, wv in zip(same, want):
        np.testing.assert_allclose(s.compact(tf.constant(s.variable.numpy())).numpy(), wv, rtol=1e-6, atol=1e-7)

    # Changed rows (row 4 kept, row 1 -> 0): that selection starts from zero, the others keep their state.
    changed_rows = trainable.rows(group, [0, 4])
    entries_sel, bias_sel = same.selections[1], same.selections[2]
    changed = TrainableSet([changed_rows, entries_sel, bias_sel])
    (entries_key,) = [key for key in optimizer.slots if key.startswith("k_0__entries")]
    entries_slot_before = optimizer.slots[entries_key][0].numpy().copy()
    optimizer.build(changed)
    assert optimizer.state_size == changed.size
    assert len(optimizer.slots) == 3
    w_before = w.numpy().copy()
    g = tf.constant(np.random.default_rng(3).normal(size=changed_rows.compact_shape).astype(np.float32))
    zeros = [tf.zeros(s.compact_shape) for s in changed.selections[1:]]
    optimizer.apply([g, *zeros])
    # Fresh momentum: the step is exactly lr * g, with no trace of row 4's old momentum.
    got_step = changed_rows.compact(tf.constant(w_before - w.numpy())).numpy()
    np.testing.assert_allclose(got_step, 0.1 * g.numpy(), rtol=1e-5, atol=1e-7)
    assert np.array_equal(w.numpy()[:, [1, 2, 3, 5]], w_before[:, [1, 2, 3, 5]])
    # Kept momentum of the entries selection keeps moving it with a zero gradient (m <- 0.9 m).
    np.testing.assert_allclose(optimizer.slots[entries_key][0].numpy(), 0.9 * entries_slot_before, rtol=1e-6)


def test_learning_rate_scale_scales_the_step():
    tset, group, mask = _sparse_setup()
    w, k, b = tset.variables
    scaled = TrainableSet([trainable.rows(group, [1, 4], learning_rate_scale=3.0),
                           trainable.entries(k, mask), trainable.dense(b, learning_rate_scale=0.5)])
    initial_compact = [s.compact(tf.constant(s.variable.numpy())).numpy() for s in scaled]
    grad_steps = _grad_sequence([s.compact_shape for s in scaled], steps=3, seed=4)
    optimizer = MaskedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9))
    optimizer.build(scaled)
    for grads in grad_steps:
        optimizer.apply(grads)
    for i, (s, lr) in enumerate(zip(scaled, (0.3, 0.1, 0.05))):
        want = _keras_reference(
            lambda lr=lr: tf.keras.optimizers.SGD(lr, momentum=0.9), [initial_compact[i]], [[g[i]] for g in grad_steps]
        )[0]
        np.testing.assert_allclose(s.compact(tf.constant(s.variable.numpy())).numpy(), want, rtol=1e-6, atol=1e-7)


def test_learning_rate_schedule_is_evaluated_at_iterations():
    schedule = tf.keras.optimizers.schedules.PiecewiseConstantDecay([0, 1], [1.0, 0.5, 0.25])
    v = tf.Variable(tf.zeros([2]))
    optimizer = MaskedOptimizer(tf.keras.optimizers.SGD(schedule))
    optimizer.build(TrainableSet.of_variables([v]))
    trajectory, rates = [], []
    for _ in range(3):
        rates.append(float(optimizer.learning_rate().numpy()))
        optimizer.apply([tf.ones([2])])
        trajectory.append(v.numpy()[0])
    assert rates == [1.0, 0.5, 0.25]
    assert trajectory == [-1.0, -1.5, -1.75]
    assert int(optimizer.keras_optimizer.iterations.numpy()) == 3
    reference = _keras_reference(
        lambda: tf.keras.optimizers.SGD(tf.keras.optimizers.schedules.PiecewiseConstantDecay([0, 1], [1.0, 0.5, 0.25])),
        [np.zeros(2, np.float32)], [[tf.ones([2])]] * 3,
    )[0]
    np.testing.assert_array_equal(v.numpy(), reference)

    # A learning rate changed on the Keras optimizer (as callbacks do) is picked up.
    plain = MaskedOptimizer(tf.keras.optimizers.SGD(0.1))
    plain.build(TrainableSet.of_variables([v]))
    plain.keras_optimizer.learning_rate = 0.25
    before = v.numpy().copy()
    plain.apply([tf.ones([2])])
    np.testing.assert_allclose(before - v.numpy(), [0.25, 0.25])


@pytest.mark.parametrize(
    "factory,match",
    [
        (lambda: tf.keras.optimizers.RMSprop(0.1), "RMSprop.*not supported.*SGD"),
        (lambda: tf.keras.optimizers.Adagrad(0.1), "Adagrad.*not supported"),
        (lambda: tf.keras.optimizers.SGD(0.1, clipnorm=1.0), "clipnorm"),
        (lambda: tf.keras.optimizers.SGD(0.1, clipvalue=1.0), "clipvalue"),
        (lambda: tf.keras.optimizers.Adam(0.1, global_clipnorm=1.0), "global_clipnorm"),
        (lambda: tf.keras.optimizers.Adam(0.1, amsgrad=True), "amsgrad"),
        (lambda: tf.keras.optimizers.SGD(0.1, use_ema=True), "use_ema"),
    ],
)
def test_unsupported_optimizers_and_options_raise(factory, match):
    with pytest.raises(ValueError, match=match):
        MaskedOptimizer(factory())


def test_apply_needs_one_gradient_per_selection():
    optimizer = MaskedOptimizer(tf.keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="build"):
        optimizer.apply([tf.ones([2])])


def test_same_named_variables_get_separate_optimizer_state():
    """Regression: optimizer state was keyed by variable name, so same-named variables shared a slot."""
    a = tf.Variable(np.ones((2, 2), np.float32), name="fc/kernel")
    b = tf.Variable(np.ones((2, 2), np.float32), name="fc/kernel")
    assert a.name == b.name
    optimizer = MaskedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9))
    optimizer.build(TrainableSet.of_variables([a, b]))
    grad_steps = [[tf.ones([2, 2]), tf.zeros([2, 2])]] * 2
    for grads in grad_steps:
        optimizer.apply(grads)
    want = _keras_reference(OPTIMIZERS["sgd_momentum"], [np.ones((2, 2), np.float32)] * 2, grad_steps)
    np.testing.assert_allclose(b.numpy(), want[1])  # b got zero gradients: it must not move
    assert optimizer.state_size == 8
    # Rebuilding with the same set keeps each variable's own state.
    optimizer.build(TrainableSet.of_variables([a, b]))
    more = [[tf.zeros([2, 2]), tf.ones([2, 2])]]
    optimizer.apply(more[0])
    want = _keras_reference(OPTIMIZERS["sgd_momentum"], [np.ones((2, 2), np.float32)] * 2, grad_steps + more)
    np.testing.assert_allclose(a.numpy(), want[0], rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), want[1], rtol=1e-6)


# ========================================================================== schedule


def test_cosine_with_warmup_shape():
    peak, total, final = 0.2, 100, 0.05
    schedule = cosine_with_warmup(peak, total, warmup_fraction=0.1, final_fraction=final)
    lr = np.array([float(schedule(t)) for t in range(total + 1)])
    assert lr[0] == 0.0
    np.testing.assert_allclose(lr[10], peak, rtol=1e-6)
    np.testing.assert_allclose(lr[:11], peak * np.arange(11) / 10, rtol=1e-6, atol=1e-8)  # linear warm-up
    np.testing.assert_allclose(lr[total], final * peak, rtol=1e-5)
    assert np.all(np.diff(lr[10:]) < 0), "not strictly decreasing after warm-up"
    t = 55
    np.testing.assert_allclose(
        lr[t], peak * (final + (1 - final) * (1 + np.cos(np.pi * (t - 10) / 90)) / 2), rtol=1e-5
    )
    np.testing.assert_allclose(float(schedule(total + 50)), final * peak, rtol=1e-5)  # stays at the floor


def test_cosine_without_warmup_and_argument_checks():
    schedule = cosine_with_warmup(0.1, 50, warmup_fraction=0.0)
    np.testing.assert_allclose(float(schedule(0)), 0.1, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(50)), 0.0, atol=1e-8)
    with pytest.raises(ValueError, match="total_steps"):
        cosine_with_warmup(0.1, 0)
    with pytest.raises(ValueError, match="warmup_fraction"):
        cosine_with_warmup(0.1, 10, warmup_fraction=1.0)
    with pytest.raises(ValueError, match="warmup_fraction"):
        cosine_with_warmup(0.1, 10, warmup_fraction=-0.1)


@pytest.mark.parametrize("strides,padding,size", [(1, "same", 9), (2, "same", 10), (2, "valid", 9), (1, "valid", 8)])
def test_three_conv_kernel_gradient_formulations_agree(strides, padding, size):
    """im2col patches, shifted views and depthwise correlations give the same per-example grads."""
    from sparta_tf.per_example.rules import conv2d

    layer = tf.keras.layers.Conv2D(3, 3, strides=strides, padding=padding)
    inputs = tf.random.stateless_normal((4, size, size, 5), seed=(1, 2))
    out = layer(inputs)
    delta = tf.random.stateless_normal(out.shape, seed=(3, 4))
    patches = conv2d.extract_patches(inputs, (3, 3), (strides, strides), (1, 1), padding.upper())
    reference = tf.matmul(tf.reshape(patches, [4, -1, 45]), tf.reshape(delta, [4, -1, 3]), transpose_a=True)
    for formulation in (conv2d.kernel_grads_shifted, conv2d.kernel_grads_depthwise):
        np.testing.assert_allclose(formulation(layer, inputs, delta), reference, rtol=1e-4, atol=1e-5)
