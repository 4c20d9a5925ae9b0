"""Every layer a user writes: the DP step's clipped sum is exact, or the model is refused in one line.

For each model of :mod:`layer_zoo` (fused activations, masks, recurrent layers, wrappers, mixed
precision, unknown dimensions), under ``engine="auto"`` (one pass; two passes, ``max_memory=0``, under
XLA) and a materialising engine, jit off and on,
traced with the batch and every dimension the model leaves open unknown:

* the clipped sum equals the one-example tape reference (float64) at clip norms where every,
  some and no example is clipped;
* padding rows (NaN-filled) contribute exactly zero, and changing only the other rows of a batch
  (padding, masks included) leaves one example's contribution bit-identical;
* one example's contribution has norm at most ``C``.
"""

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from layer_zoo import (
    CASES,
    L,
    assert_matches_reference,
    assert_one_example_is_isolated_and_bounded,
    flat,
    loss_fn,
    norms,
    reference_clipped_sum,
    reference_gradients,
)
from sparta_tf.per_example import make_engine
from sparta_tf.per_example.bookkeeping import clipped_batch
from sparta_tf.per_example.errors import UnsupportedLayerError

FLOAT_TOLERANCE = 1e-5  # relative to the step's largest coordinate (ghost norms: rounding margin below this)
LOW_PRECISION_TOLERANCE = 3e-2  # the reference runs the model in bfloat16 / float16, ours sums in float32
MATERIALISING = {"subclassed_add_weight": "vectorized"}  # the model's own weight: no leaf layer owns it


def _engine(model, case_name: str, engine_name: str):
    if engine_name == "auto":
        return make_engine(model, model.trainable_variables, "auto")
    if engine_name == "two_pass":  # no room for one pass: every tappable layer streams its output gradient
        return make_engine(model, model.trainable_variables, "auto", max_memory=0)
    return make_engine(model, model.trainable_variables, MATERIALISING.get(case_name, "layerwise"))


def _step(case, engine, jit: bool):
    def step(x, y, valid, clip_norm):
        return clipped_batch(engine, x, y, loss_fn, valid, clip_norm).sums

    signature = [case.signature(), tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.bool),
                 tf.TensorSpec([], tf.float32)]
    return tf.function(step, input_signature=signature, jit_compile=jit)


@pytest.mark.parametrize("engine_name", ["auto", "two_pass", "materialising"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_clipped_sum_equals_the_one_example_reference(name, engine_name):
    case = CASES[name]
    tf.keras.utils.set_random_seed(0)
    model = case.build()
    x, y, valid = case.batch(seed=1)
    reference = reference_gradients(model, x, y, valid)
    example_norms = norms(reference)
    engine = _engine(model, name, engine_name)
    tolerance = LOW_PRECISION_TOLERANCE if case.low_precision else FLOAT_TOLERANCE
    # the two-pass step under XLA only (where the two backward passes could be fused differently and
    # round apart); test_bookkeeping runs it without XLA on every rule
    for jit in ((True,) if engine_name == "two_pass" else (False, True)):
        step = _step(case, engine, jit)
        for clip_norm in (example_norms.min() / 2, np.median(example_norms), example_norms.max() * 2):
            ours = flat(step(x, y, valid, np.float32(clip_norm)))
            assert_matches_reference(ours, reference_clipped_sum(reference, clip_norm), model.trainable_variables,
                                     tolerance, f"jit={jit} C={clip_norm:.3g}")

        # Padding contributes exactly zero, and one example's contribution depends on its own row only.
        assert_one_example_is_isolated_and_bounded(step, case, x, y, valid, np.float32(example_norms[0] / 10),
                                                   model.trainable_variables, jit)


def _stateful_lstm():
    inputs = tf.keras.Input((5, 3), batch_size=4)
    return tf.keras.Model(inputs, L.Dense(3)(L.LSTM(4, stateful=True)(inputs)))


class _ReadsAnotherLayersKernel(L.Layer):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def call(self, x):
        return tf.matmul(x, self.owner.kernel)


def _tied_kernel():
    inputs = tf.keras.Input((4,))
    owner = L.Dense(4)
    return tf.keras.Model(inputs, L.Dense(3)(_ReadsAnotherLayersKernel(owner)(owner(inputs))))


def _dense_in_a_loop():
    class Loop(L.Layer):
        def __init__(self):
            super().__init__()
            self.dense = L.Dense(4, activation="tanh")

        def call(self, x):
            return tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, self.dense(h)), (0, x))[1]

    inputs = tf.keras.Input((4,))
    return tf.keras.Model(inputs, L.Dense(3)(Loop()(inputs)))


REFUSED = {
    "stateful_lstm": (_stateful_lstm, r"recurrent layer 'lstm\w*' is stateful.*stateful=False"),
    "lstm_dropout": (lambda: tf.keras.Sequential([tf.keras.Input((5, 3)), L.LSTM(4, dropout=0.2), L.Dense(3)]),
                     r"dropout=0.2.*set dropout=0 and recurrent_dropout=0"),
    "kernel_read_by_another_layer": (_tied_kernel, r"variable '\S*dense\w*/kernel(:0)?' .*do not add up"),
    "dense_called_in_a_while_loop": (_dense_in_a_loop, r"variable '\S*dense\w*/kernel(:0)?' .*do not add up"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_no_rule_makes_exact_is_refused_before_the_first_step_in_one_line(name):
    build, message = REFUSED[name]
    tf.keras.utils.set_random_seed(0)
    model = build()
    dp = sparta_tf.DPModel(model, noise_multiplier=1.0, sample_rate=0.5, seed=0)
    dp.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy() for v in model.variables]
    x = np.random.RandomState(0).randn(8, *model.input_shape[1:]).astype(np.float32)
    with pytest.raises(UnsupportedLayerError, match=message) as info:
        dp.fit(x, np.arange(8) % 3, epochs=1, verbose=0)
    assert "\n" not in str(info.value)
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)  # refused before any step


def test_recurrent_layers_are_refused_by_the_whole_model_vectorized_engine_in_one_line():
    model = tf.keras.Sequential([tf.keras.Input((5, 3)), L.GRU(4), L.Dense(3)])
    with pytest.raises(UnsupportedLayerError, match=r"engine='vectorized' .*recurrent layer 'gru\w*'.*engine='auto'"):
        make_engine(model, model.trainable_variables, "vectorized")


FIT_CASES = ["lstm", "bidirectional_lstm", "lstm_masked", "gru_reset_before_backwards", "time_distributed_conv2d",
             "attention_masked", "embedding_unknown_length", "conv2d_valid_strides_relu", "mixed_bfloat16",
             "mixed_float16", "float64"]


@pytest.mark.parametrize("name", FIT_CASES)
def test_one_fit_step_moves_every_weight_by_its_clipped_gradient(name):
    """End to end through ``DPModel.fit`` on a dataset whose batch and open dimensions are unknown
    (``from_generator``): with sigma = 0 and SGD(lr=1), one step changes the weights by exactly
    ``-S / (q n)`` -- recurrent weights included (they used to stay put)."""
    case = CASES[name]
    tf.keras.utils.set_random_seed(0)
    model = case.build()
    x, y, valid = case.batch(seed=1)
    x = tf.nest.map_structure(lambda t: t[: len(y)][valid], x)
    y = y[valid]
    expected = reference_clipped_sum(reference_gradients(model, x, y, np.ones(len(y), bool)), 1.0)
    dataset = tf.data.Dataset.from_generator(lambda: iter([(x, y)]), output_signature=(
        case.signature(), tf.TensorSpec([None], tf.int64)))
    dp = sparta_tf.DPModel(model, noise_multiplier=0.0, clip_norm=1.0, sample_rate=0.5, dataset_size=2 * len(y))
    dp.compile(optimizer=tf.keras.optimizers.SGD(1.0),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    before = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    dp.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)
    tolerance = LOW_PRECISION_TOLERANCE if case.low_precision else FLOAT_TOLERANCE
    scale = max(float(np.max(np.abs(e))) for e in expected) / len(y)
    for variable, old, total in zip(model.trainable_variables, before, expected):
        moved = np.asarray(variable.numpy(), np.float64) - old
        error = float(np.max(np.abs(moved + total / len(y)))) / scale
        assert error <= max(tolerance, 1e-4), f"{variable.name}: {error:.2e}"  # 1e-4: float32 weights


def test_mixed_float16_policy_compiles_without_loss_scaling():
    """Under the global ``mixed_float16`` policy Keras wraps the optimizer in a LossScaleOptimizer;
    the DP step uses the optimizer inside it (no data-dependent loss scale) and trains."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = tf.keras.Sequential([tf.keras.Input((4,)), L.Dense(5, activation="relu"),
                                     L.Dense(3, dtype="float32")])
        dp = sparta_tf.DPModel(model, noise_multiplier=0.5, sample_rate=0.5, seed=0)
        dp.compile(optimizer=tf.keras.optimizers.SGD(0.1),
                   loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        assert "LossScale" in type(dp.optimizer).__name__
        before = model.layers[0].kernel.numpy()
        x = np.random.RandomState(0).randn(16, 4).astype(np.float32)
        history = dp.fit(x, np.arange(16) % 3, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][-1])
        assert not np.array_equal(before, model.layers[0].kernel.numpy())
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


def _low_precision_mlp(dtype: str):
    return tf.keras.Sequential([tf.keras.Input((16,)), L.Dense(32, activation="relu", dtype=dtype),
                                L.Dense(32, dtype=dtype), L.Dense(3, dtype=dtype)])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_example_stays_within_the_clip_bound_in_low_precision(dtype):
    """Norms, clip factors and sums in float32: one example's clipped contribution has norm <= C
    (computed in bfloat16 / float16 it reached 1.0057 C / 1.036 C)."""
    tf.keras.utils.set_random_seed(3)
    model = _low_precision_mlp(dtype)
    engine = make_engine(model, model.trainable_variables, "auto")
    step = tf.function(lambda x, y, valid, c: clipped_batch(engine, x, y, loss_fn, valid, c).sums)
    rs = np.random.RandomState(0)
    x, y = rs.randn(16, 16).astype(np.float32), rs.randint(0, 3, 16)
    for i in range(16):
        single = np.arange(16) == i
        for clip_norm in (np.float32(1e-3), np.float32(0.37)):
            sums = step(x, y, single, clip_norm)
            norm = np.sqrt(sum(float(np.sum(np.square(np.asarray(s, np.float64)))) for s in sums))
            assert 0 < norm <= clip_norm, (i, clip_norm, norm)


class _MatMul(tf.keras.layers.Layer):
    """A layer of no known rule (the generic per-example VJP) whose kernel gradient is larger than its
    output gradient, so that a one-pass step would keep ``delta`` and re-run the VJP for the sums."""

    def build(self, shape):
        self.kernel = self.add_weight(name="kernel", shape=(shape[-1], 8), initializer="glorot_uniform")

    def call(self, x):
        return tf.matmul(x, self.kernel)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_generic_rule_layer_in_low_precision_stays_within_the_clip_bound(policy):
    """Its sum re-run on ``c * delta`` rounded to bfloat16 reached 1.0014 C: the step sums the per-example
    gradients whose norm was clipped instead."""
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.Input((16,)), _MatMul(dtype=policy), L.Dense(3, dtype="float32")])
    engine = make_engine(model, model.trainable_variables, "auto")
    step = tf.function(lambda x, y, valid, c: clipped_batch(engine, x, y, loss_fn, valid, c).sums)
    rs = np.random.RandomState(0)
    clip_norm = np.float32(1e-3)
    for _ in range(3):
        x, y = rs.randn(16, 16).astype(np.float32), rs.randint(0, 3, 16)
        for i in range(16):
            sums = step(x, y, np.arange(16) == i, clip_norm)
            norm = np.sqrt(sum(float(np.sum(np.square(np.asarray(s, np.float64)))) for s in sums))
            assert 0 < norm <= clip_norm, (i, norm / clip_norm)


def test_float16_squares_do_not_overflow_and_drop_examples():
    """A float16 squared norm above 65504 would be inf and drop the example; in float32 it is clipped."""
    tf.keras.utils.set_random_seed(4)
    model = _low_precision_mlp("float16")
    engine = make_engine(model, model.trainable_variables, "auto")
    step = tf.function(lambda x, y, valid: clipped_batch(engine, x, y, loss_fn, valid, 1.0))
    rs = np.random.RandomState(1)
    x, y = 100 * rs.randn(8, 16).astype(np.float32), rs.randint(0, 3, 8)
    squared = step(x, y, tf.ones([8], bool)).squared_norms.numpy()
    assert np.all(np.isfinite(squared)) and np.sum(squared > 65504) >= 2, squared
    for i in np.flatnonzero(squared > 65504):
        sums = step(x, y, np.arange(8) == i).sums
        norm = np.sqrt(sum(float(np.sum(np.square(np.asarray(s, np.float64)))) for s in sums))
        assert 0.999 <= norm <= 1.0, (i, norm)  # clipped to C = 1, not dropped


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_the_coverage_check_accepts_a_mixed_precision_transformer(policy):
    """The batch gradient of a bfloat16 model rounds in bfloat16 (an 11% error on a small ViT's MLP bias
    against the float32 sum of the same terms): the check's tolerance follows the compute dtype, so a
    covered model is not refused."""
    from sparta_tf.models import vit_tiny
    from sparta_tf.per_example.coverage import check_coverage

    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        tf.keras.utils.set_random_seed(0)
        model = vit_tiny(num_classes=10, input_shape=(32, 32, 3), patch_size=4, dim=32, depth=2, heads=2, mlp_dim=64)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    engine = make_engine(model, model.trainable_variables, "auto")
    x = np.random.RandomState(0).rand(4, 32, 32, 3).astype(np.float32)
    check_coverage(engine, x, np.arange(4), loss_fn)  # raises UnsupportedLayerError when refused


def _row_selections(model):
    """Rows 0 and the last of every maskable kernel (SPARTA's sparse phase), every other variable whole."""
    from sparta_tf import trainable as trainable_lib
    from sparta_tf.groups import row_groups

    groups = {id(g.variable): g for g in row_groups(model)}
    return [trainable_lib.rows(groups[id(v)], [0, groups[id(v)].n_rows - 1])
            if id(v) in groups and groups[id(v)].n_rows > 2 else trainable_lib.dense(v)
            for v in model.trainable_variables]


@pytest.mark.parametrize("engine_name", ["auto", "materialising"])
@pytest.mark.parametrize("name", sorted(n for n in CASES if n != "subclassed_add_weight"))
def test_clipped_sum_over_selected_rows_equals_the_one_example_reference(name, engine_name):
    """Sparse selections (rows of the maskable kernels): norms and sums over the selected
    coordinates only, against the reference restricted to them."""
    case = CASES[name]
    tf.keras.utils.set_random_seed(0)
    model = case.build()
    selections = _row_selections(model)
    x, y, valid = case.batch(seed=1)
    reference = [[np.asarray(s.compact(tf.constant(g)), np.float64) for s, g in zip(selections, grads)]
                 for grads in reference_gradients(model, x, y, valid)]
    clip_norm = float(np.median(norms(reference)))
    engine = (make_engine(model, selections, "auto") if engine_name == "auto"
              else make_engine(model, selections, "layerwise"))
    ours = flat(tf.function(lambda: clipped_batch(engine, x, y, loss_fn, valid, clip_norm).sums)())
    expected = reference_clipped_sum(reference, clip_norm)
    scale = max(float(np.max(np.abs(e))) for e in expected)
    tolerance = LOW_PRECISION_TOLERANCE if case.low_precision else FLOAT_TOLERANCE
    for selection, a, b in zip(selections, ours, expected):
        assert a.shape == b.shape, selection.variable.name
        error = float(np.max(np.abs(a - b), initial=0.0)) / scale
        assert error <= tolerance, f"{selection.variable.name} ({selection.kind}): {error:.2e}"


def test_convolution_norms_over_chunks_of_the_batch_equal_the_whole_batch(monkeypatch):
    """A layer whose per-example temporaries exceed the chunk budget computes its per-example
    gradients a chunk of examples at a time (the fewest chunks that fit, of equal size, padded to
    whole chunks): the same clipped sum."""
    from sparta_tf.per_example import chunking
    from sparta_tf.per_example.rules import conv2d

    case = CASES["conv2d_valid_strides_relu"]
    tf.keras.utils.set_random_seed(0)
    model = case.build()
    x, y, valid = case.batch(seed=1)
    engine = make_engine(model, model.trainable_variables, "auto")
    whole = flat(tf.function(lambda: clipped_batch(engine, x, y, loss_fn, valid, 0.5).sums)())
    per_example = 4 * 6 * 18  # float32 patches: 3x2 output positions of a 3x3 kernel on 2 channels
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4 * per_example)  # at most 4 examples: 6 rows in 2 chunks of 3
    calls = []
    monkeypatch.setattr(conv2d, "map_over_examples",
                        lambda *args: calls.append(args[2]) or chunking.map_over_examples(*args))
    chunked = flat(tf.function(lambda: clipped_batch(engine, x, y, loss_fn, valid, 0.5).sums)())
    assert calls == [3]
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_chunks_are_the_fewest_that_fit_and_of_equal_size():
    from sparta_tf.per_example import chunking

    budget = chunking.CHUNK_BYTES
    assert chunking.chunk_size(budget // 256, 256) is None  # the whole batch fits
    assert chunking.chunk_size(budget // 227, 256) == 128  # not 227 (256 rows padded to 454)
    assert chunking.chunk_size(budget // 227, 512) == 171  # 3 chunks, 513 rows
    assert chunking.chunk_size(budget, 7) == 1 and chunking.chunk_size(2 * budget, 7) == 1
    rows = tf.reshape(tf.range(7.0), [7, 1])
    doubled = chunking.map_over_examples(lambda t: 2 * t, [rows], 4, [1], tf.float32)  # 7 rows padded to 8
    np.testing.assert_array_equal(doubled.numpy(), 2 * rows.numpy())


# Layers of the speed benchmark's models that keep the per-layer VJP (docs/layers.md): exact, and
# elementwise, so cheap; no rule matches them by class.
VJP_BY_DESIGN = {"LayerScale": "ConvNeXt's per-channel scale, a keras.applications-internal class"}


def test_no_model_of_the_speed_benchmark_takes_the_per_layer_vjp_fallback():
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import zoo_speed
    from sparta_tf.per_example import GhostRule, LayerwiseEngine, VjpRule, ghost_rule_for
    from sparta_tf.per_example.factory import as_selections

    for name, spec in zoo_speed.MODELS.items():
        tf.keras.utils.set_random_seed(0)
        model = spec.build()
        plan, reason = LayerwiseEngine.plan_for(model, as_selections(model.trainable_variables), ghost_rule_for)
        assert plan is not None, f"{name}: {reason}"
        fallback = {type(layer).__name__ for layer, rule, _ in plan
                    if type(rule) is GhostRule and isinstance(rule.reference, VjpRule)}
        assert fallback <= set(VJP_BY_DESIGN), f"{name}: {sorted(fallback - set(VJP_BY_DESIGN))}"
        tf.keras.backend.clear_session()
