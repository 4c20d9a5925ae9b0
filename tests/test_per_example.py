"""Per-example gradients: both engines agree with per-example GradientTape."""

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.per_example import LayerwiseEngine, VectorizedEngine, make_engine
from sparta_tf.per_example.patches import extract_patches
from small_models import per_example_loss, tape_gradients

L = tf.keras.layers


def mixed_model():
    """Conv (same/valid/strided/dilated, with and without bias), GN, LN, Dense with activation, shared layer."""
    inputs = L.Input((9, 9, 3))
    h = L.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    h = L.GroupNormalization(2)(h)
    h = L.Conv2D(6, 3, strides=2, padding="valid", use_bias=False)(h)
    h = L.Conv2D(6, 2, dilation_rate=2, padding="same")(h)
    h = L.LayerNormalization()(h)
    h = L.GlobalAveragePooling2D()(h)
    shared = L.Dense(6, name="shared")
    h = shared(L.Dense(6, activation="tanh")(shared(h)))
    return tf.keras.Model(inputs, L.Dense(3, name="head")(h))


@pytest.mark.parametrize("engine_cls", [LayerwiseEngine, VectorizedEngine])
def test_engines_match_per_example_tape(engine_cls):
    tf.keras.utils.set_random_seed(0)
    model = mixed_model()
    x = tf.random.normal([5, 9, 9, 3])
    y = tf.constant([0, 1, 2, 1, 0])
    engine = make_engine(model, model.trainable_variables, engine_cls.name)
    assert isinstance(engine, engine_cls)
    result = tf.function(lambda: engine(x, y, per_example_loss, tf.ones([5], bool)))()
    for got, want in zip(result.grads, tape_gradients(model, x, y)):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-5)


def test_layerwise_handles_a_subset_and_nested_models():
    tf.keras.utils.set_random_seed(1)
    inner = tf.keras.Sequential([L.Dense(5, activation="relu"), L.Dense(4)], name="inner")
    inputs = L.Input((3,))
    model = tf.keras.Model(inputs, L.Dense(2, name="head")(inner(inputs)))
    subset = [inner.layers[1].kernel, model.get_layer("head").bias]
    engine = make_engine(model, subset, materialise=True)
    assert isinstance(engine, LayerwiseEngine)
    x, y = tf.random.normal([4, 3]), tf.constant([0, 1, 1, 0])
    result = engine(x, y, per_example_loss, tf.ones([4], bool))
    assert [g.shape.as_list() for g in result.grads] == [[4, 5, 4], [4, 2]]
    want = tape_gradients(model, x, y)
    index = {id(v): k for k, v in enumerate(model.trainable_variables)}
    for got, var in zip(result.grads, subset):
        np.testing.assert_allclose(got.numpy(), want[index[id(var)]], rtol=1e-4, atol=1e-6)


def test_model_level_weights_fall_back_to_vectorized():
    class WithFreeWeight(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = L.Dense(2)
            # the model's own weight (Keras 3 does not track a bare tf.Variable attribute)
            self.scale = self.add_weight(name="scale", shape=(), initializer=tf.keras.initializers.Constant(1.5))

        def call(self, x, training=None):
            return self.dense(x) * self.scale

    model = WithFreeWeight()
    model(tf.zeros([1, 3]))
    assert len(model.trainable_variables) == 3
    assert isinstance(make_engine(model, model.trainable_variables), VectorizedEngine)
    with pytest.raises(ValueError, match="layerwise"):
        make_engine(model, model.trainable_variables, "layerwise")


def test_no_silent_while_loop_fallback_in_layerwise_engine():
    """The layer-wise engine must not hit pfor's per-example while_loop fallbacks.

    (Unused Conv2DBackpropFilter nodes built by the conv gradient function are
    pruned by grappler at run time; only loops would cost per example.)
    """
    model = mixed_model()
    engine = make_engine(model, model.trainable_variables, materialise=True)
    x, y = tf.random.normal([3, 9, 9, 3]), tf.constant([0, 1, 2])
    graph = tf.function(lambda: engine(x, y, per_example_loss, tf.ones([3], bool)).grads).get_concrete_function().graph
    op_types = {op.type for op in graph.get_operations()}
    assert "While" not in op_types and "StatelessWhile" not in op_types


@pytest.mark.parametrize("padding,stride,dilation", [("SAME", 1, 1), ("SAME", 2, 1), ("VALID", 2, 1), ("SAME", 1, 2)])
def test_patches_match_convolution(padding, stride, dilation):
    x = tf.random.normal([2, 7, 8, 3])
    kernel = tf.random.normal([3, 2, 3, 4])
    want = tf.nn.convolution(x, kernel, strides=stride, padding=padding, dilations=dilation)
    patches = extract_patches(x, (3, 2), (stride, stride), (dilation, dilation), padding)
    got = tf.tensordot(patches, tf.reshape(kernel, [-1, 4]), axes=1)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
