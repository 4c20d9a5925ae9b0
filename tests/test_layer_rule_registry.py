"""The public layer-rule registry: lookup, user rules exact, wrong user rules refused before the first step.

A user layer ``ScaledDense`` (``y = s (x W + b)``, its own ``call``) gets the generic per-example VJP
until a rule is registered for it; a correct user rule (materialising and book-keeping) gives the
same clipped sum as the one-example-at-a-time tape reference, and rules that are wrong in each way
a rule can be (per-example gradients, a missed variable, norms, the weighted sum) are refused by
the coverage check, in one line naming the layer and the rule.
"""

import numpy as np
import pytest
import tensorflow as tf

from layer_zoo import norms, reference_clipped_sum, reference_gradients
from sparta_tf.backend import variable_key
from sparta_tf.dp_model import DPModel
from sparta_tf.per_example import (
    BookkeepingEngine,
    GhostRule,
    LayerRule,
    LayerwiseEngine,
    NormMethod,
    UnsupportedLayerError,
    VjpRule,
    ghost_rule_for,
    make_engine,
    register_layer_rule,
    rule_for,
)
from sparta_tf.per_example.bookkeeping import clipped_batch
from sparta_tf.per_example.coverage import check_coverage
from sparta_tf.per_example.rules.base import keep_examples
from sparta_tf.per_example.rules.dense import DenseRule, LinearGhostRule

L = tf.keras.layers


def loss_fn(y, logits):
    return tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


class ScaledDense(L.Layer):
    """``y = s (x W + b)`` on ``[B, d]`` input, with a ``call`` of its own."""

    def __init__(self, units, scale=3.0, **kwargs):
        super().__init__(**kwargs)
        self.units, self.scale = units, scale

    def build(self, shape):
        self.kernel = self.add_weight(name="kernel", shape=(shape[-1], self.units), initializer="glorot_uniform")
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="random_normal")

    def call(self, x):
        return self.scale * (tf.matmul(x, self.kernel) + self.bias)


class ScaledDenseRule(LayerRule):
    """``g_i(W) = a_i^T (s delta_i)``, ``g_i(b) = s delta_i``."""

    scale_delta = True

    def variable_grad(self, layer, call, delta, selection):
        d = layer.scale * delta if self.scale_delta else delta
        if selection.variable is layer.kernel:
            return tf.cast(call.inputs, d.dtype)[:, :, None] * d[:, None, :]
        return d


class ScaledDenseGhostRule(GhostRule):
    """Rank one: ``||g_i(W)||^2 = ||a_i||^2 ||s delta_i||^2``; ``S(W) = a^T (s c delta)``."""

    reference = ScaledDenseRule()

    def squared_norms(self, layer, call, delta, selections, materialised=None):
        a, d = tf.cast(call.inputs, delta.dtype), layer.scale * delta
        row = tf.reduce_sum(tf.square(d), axis=1)
        parts = [tf.reduce_sum(tf.square(a), axis=1) * row if s.variable is layer.kernel else row for s in selections]
        return tf.add_n(parts), [NormMethod(layer.name, variable_key(s.variable), "rank_one", None, None)
                                 for s in selections]

    def weighted_sums(self, layer, call, delta_c, keep, selections):
        a, d = keep_examples(tf.cast(call.inputs, delta_c.dtype), keep), layer.scale * delta_c
        return [tf.matmul(a, d, transpose_a=True) if s.variable is layer.kernel else tf.reduce_sum(d, axis=0)
                for s in selections]


register_layer_rule(ScaledDense, ScaledDenseGhostRule)


# Deliberately wrong user rules, one layer class each (registrations are global).
class ForgetsScale(ScaledDense):
    pass


class MissesBias(ScaledDense):
    pass


class WrongNorms(ScaledDense):
    pass


class IgnoresClipFactors(ScaledDense):
    pass


class SameForEveryExample(ScaledDense):
    pass


@register_layer_rule(ForgetsScale)
class ForgetsScaleRule(ScaledDenseRule):
    scale_delta = False


@register_layer_rule(MissesBias)
class MissesBiasRule(ScaledDenseRule):
    def variable_grad(self, layer, call, delta, selection):
        grads = super().variable_grad(layer, call, delta, selection)
        return grads if selection.variable is layer.kernel else tf.zeros_like(grads)


@register_layer_rule(WrongNorms)
class WrongNormsRule(ScaledDenseGhostRule):
    def squared_norms(self, layer, call, delta, selections, materialised=None):
        squared, methods = super().squared_norms(layer, call, delta, selections, materialised)
        return squared / 4.0, methods  # every example clipped at twice C


@register_layer_rule(IgnoresClipFactors)
class IgnoresClipFactorsRule(ScaledDenseGhostRule):
    """Rescales ``c * delta`` by its largest entry before summing: the clip factors ``c_i`` are lost."""

    def weighted_sums(self, layer, call, delta_c, keep, selections):
        unclipped = tf.where(tf.abs(delta_c) > 0, delta_c / tf.reduce_max(tf.abs(delta_c)), 0.0)
        return super().weighted_sums(layer, call, unclipped, keep, selections)


@register_layer_rule(SameForEveryExample)
class SameForEveryExampleRule(ScaledDenseRule):
    """The batch mean for every example: the sum over examples is right, each example is not."""

    def per_example_grads(self, layer, call, delta, selections):
        grads = super().per_example_grads(layer, call, delta, selections)
        return [tf.zeros_like(g) + tf.reduce_mean(g, axis=0, keepdims=True) for g in grads]


def _model(layer_class=ScaledDense, seed=0):
    tf.keras.utils.set_random_seed(seed)
    inputs = tf.keras.Input((6,))
    hidden = L.Activation("tanh")(layer_class(5, name="scaled")(inputs))
    return tf.keras.Model(inputs, L.Dense(3, name="head")(hidden))


def _batch(n=6):
    rs = np.random.RandomState(1)
    return rs.randn(n, 6).astype(np.float32), rs.randint(0, 3, n)


def test_lookup_is_exact_class_unless_subclasses_are_asked_for():
    class Plain(L.Layer):
        pass

    class Child(Plain):
        pass

    class GrandChild(Child):
        pass

    assert isinstance(rule_for(Plain()), VjpRule)  # no entry: the generic per-example VJP
    register_layer_rule(Plain, DenseRule)
    assert isinstance(rule_for(Plain()), DenseRule)
    assert isinstance(rule_for(Child()), VjpRule)  # a subclass may override call
    assert isinstance(ghost_rule_for(Child()), GhostRule) and isinstance(ghost_rule_for(Child()).reference, VjpRule)
    register_layer_rule(Plain, DenseRule, subclasses=True, replace=True)
    assert isinstance(rule_for(GrandChild()), DenseRule)
    assert isinstance(rule_for(L.Dense(2)), DenseRule) and isinstance(ghost_rule_for(L.Dense(2)), LinearGhostRule)
    assert isinstance(rule_for(type("MyDense", (L.Dense,), {})(2)), VjpRule)


def test_registration_errors_are_one_line_and_name_the_fix():
    class Twice(L.Layer):
        pass

    register_layer_rule(Twice, VjpRule())
    with pytest.raises(ValueError, match="already has the rule VjpRule; pass replace=True"):
        register_layer_rule(Twice, DenseRule())
    with pytest.raises(TypeError, match="not a Keras layer class"):
        register_layer_rule(int, DenseRule())
    with pytest.raises(TypeError, match="not a LayerRule, a GhostRule"):
        register_layer_rule(Twice, 3, replace=True)

    class BadFactory(L.Layer):
        pass

    register_layer_rule(BadFactory, lambda layer: "dense")
    with pytest.raises(TypeError, match="returned 'dense'"):
        rule_for(BadFactory())


def test_a_correct_user_rule_is_used_and_exact_against_the_one_example_reference():
    model = _model()
    x, y = _batch()
    valid = np.array([True] * 4 + [False] * 2)
    x[4:] = np.nan  # padding rows contribute exactly zero
    engine = make_engine(model, model.trainable_variables)
    assert isinstance(engine, BookkeepingEngine)
    assert {type(rule) for layer, rule, _ in engine.plan if layer.name == "scaled"} == {ScaledDenseGhostRule}
    check_coverage(engine, x[:4], y[:4], loss_fn)  # accepted

    reference = reference_gradients(model, x, y, valid)
    for clip_norm in (1e3, float(np.median(norms(reference))), 1e-3):  # none, some, all clipped
        ours = clipped_batch(engine, x, y, loss_fn, tf.constant(valid), clip_norm).sums
        for a, b in zip(ours, reference_clipped_sum(reference, clip_norm)):
            np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-5, atol=1e-6)

    layerwise = make_engine(model, model.trainable_variables, materialise=True)
    assert isinstance(layerwise, LayerwiseEngine)
    grads = layerwise(x, y, loss_fn, tf.constant(valid)).grads
    for k in range(len(model.trainable_variables)):
        np.testing.assert_allclose(np.asarray(grads[k])[:4], np.stack([g[k] for g in reference]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer_class, rule, what", [
    (ForgetsScale, "ForgetsScaleRule", "wrong per-example gradients for variable '.*kernel"),
    (MissesBias, "MissesBiasRule", "wrong per-example gradients for variable '.*bias"),
    (SameForEveryExample, "SameForEveryExampleRule", "wrong per-example gradients"),
    (WrongNorms, "WrongNormsRule", "wrong per-example norms"),
    (IgnoresClipFactors, "IgnoresClipFactorsRule", r"a wrong weighted sum sum_i c_i g_i for variable '.*kernel"),
])
@pytest.mark.parametrize("materialise", [False, True])
def test_a_wrong_user_rule_is_refused_naming_the_layer_and_the_rule(layer_class, rule, what, materialise):
    model = _model(layer_class)
    x, y = _batch(4)
    engine = make_engine(model, model.trainable_variables, materialise=materialise)
    message = rf"^the rule {rule} registered for {layer_class.__name__} \(layer 'scaled'\) gives {what}.*replace=True"
    with pytest.raises(UnsupportedLayerError, match=message) as info:
        check_coverage(engine, x, y, loss_fn)
    assert "\n" not in str(info.value)


def test_a_rule_that_raises_is_refused_in_one_line():
    class Raises(ScaledDense):
        pass

    @register_layer_rule(Raises)
    def raising_rule(layer):
        class Only(ScaledDenseRule):
            def variable_grad(self, layer, call, delta, selection):
                if selection.variable is layer.bias:
                    raise ValueError("no bias rule\nsecond line")
                return super().variable_grad(layer, call, delta, selection)
        return Only()

    model = _model(Raises)
    x, y = _batch(4)
    with pytest.raises(UnsupportedLayerError, match=r"^the rule .*raising_rule registered for Raises .*"
                                                    r"raised ValueError: no bias rule;") as info:
        check_coverage(make_engine(model, model.trainable_variables), x, y, loss_fn)
    assert "\n" not in str(info.value)


def test_dp_model_refuses_a_wrong_user_rule_before_the_first_step():
    model = _model(ForgetsScale)
    before = [v.numpy() for v in model.trainable_variables]
    x, y = _batch(8)
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.5, dataset_size=8, seed=0)
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(UnsupportedLayerError, match="the rule ForgetsScaleRule registered for ForgetsScale"):
        dp.fit(x, y, epochs=1, verbose=0)
    for a, b in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(a, b.numpy())
