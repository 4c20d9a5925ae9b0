"""Keras 3 model sources of the ``model:`` section: keras-hub image backbones (``model.name: keras_hub``)
and Keras 3 ``.keras`` files (``model.name: saved``), BatchNorm converted to GroupNorm as for keras-cv.

On Keras 2 the keras-hub choice is a one-line error naming the fix (keras-hub builds Keras 3 models),
as the keras-cv choice is on Keras 3.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.backend import KERAS3
from sparta_tf.models import HEAD_LAYER_NAME, build_model, validate_model_spec
from sparta_tf.models.backbones import keras_hub_backbone_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_keras3 = pytest.mark.skipif(
    not KERAS3, reason="keras-hub 0.32 and Keras 3 .keras files need Keras 3 (the TF 2.21 line, Python 3.12/3.13); "
                       "Keras 2 gets the one-line error of test_keras_hub_on_keras2_is_one_line_naming_the_fix")

# The smallest ResNetBackbone keras-hub accepts (its first stage must have 64 filters, as the stem).
HUB_ARGS = dict(input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 32],
                stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block")
HUB_SPEC = {"name": "keras_hub", "backbone": "ResNetBackbone", "backbone_args": HUB_ARGS}


def _layer_classes(model):
    return [type(layer).__name__ for layer in model._flatten_layers(include_self=False, recursive=True)]


def _one_line_error(spec, *build_args):
    with pytest.raises(ValueError) as info:
        if build_args:
            build_model(spec, *build_args)
        else:
            validate_model_spec(spec)
    message = str(info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------- Keras 2


@pytest.mark.skipif(KERAS3, reason="on Keras 3 model.name=keras_hub builds (the tests below)")
def test_keras_hub_on_keras2_is_one_line_naming_the_fix():
    message = _one_line_error(HUB_SPEC)
    assert message.startswith("model.name=keras_hub needs Keras 3")
    assert "pip install -e ." in message and "keras_cv" in message


# -------------------------------------------------------------- keras-hub


@needs_keras3
def test_keras_hub_image_backbones_are_the_image_classifiers_backbones():
    names = keras_hub_backbone_names()
    assert {"ResNetBackbone", "EfficientNetBackbone", "ViTBackbone", "MobileNetBackbone"} <= set(names)
    assert not any("Gemma" in name or "Bert" in name for name in names)  # text backbones are not offered


@needs_keras3
def test_keras_hub_backbone_gets_groupnorm_pool_and_a_fresh_head():
    model = build_model(HUB_SPEC, 5, (16, 16, 3))
    head = model.get_layer(HEAD_LAYER_NAME)
    assert head is model.layers[-1] and isinstance(head, tf.keras.layers.Dense) and head.units == 5
    assert model.get_layer("pool").output.shape == (None, 32)
    import keras_hub

    original = _layer_classes(keras_hub.models.ResNetBackbone(image_shape=(16, 16, 3), **HUB_ARGS))
    classes = _layer_classes(model)
    assert "BatchNormalization" not in classes
    assert classes.count("GroupNormalization") == original.count("BatchNormalization") > 0
    assert model(np.zeros((2, 16, 16, 3), np.float32)).shape == (2, 5)


@needs_keras3
def test_keras_hub_freeze_keeps_batchnorm_in_inference_mode():
    model = build_model(dict(HUB_SPEC, batchnorm="freeze"), 3, (16, 16, 3))
    batchnorms = [layer for layer in model._flatten_layers(include_self=False, recursive=True)
                  if isinstance(layer, tf.keras.layers.BatchNormalization)]
    assert batchnorms and not any(layer.trainable for layer in batchnorms)
    x = np.random.default_rng(0).normal(size=(4, 16, 16, 3)).astype(np.float32)
    together = model(x, training=True).numpy()
    alone = model(x[:1], training=True).numpy()
    np.testing.assert_allclose(together[:1], alone, rtol=1e-5, atol=1e-5)  # per-example in training mode


@needs_keras3
def test_keras_hub_weights_come_from_the_file_and_are_random_without_it(tmp_path):
    import keras_hub

    tf.keras.utils.set_random_seed(1)
    backbone = keras_hub.models.ResNetBackbone(image_shape=(16, 16, 3), **HUB_ARGS)
    path = str(tmp_path / "backbone.weights.h5")
    backbone.save_weights(path)
    conv = next(layer for layer in backbone.layers if isinstance(layer, tf.keras.layers.Conv2D))

    tf.keras.utils.set_random_seed(2)
    loaded = build_model(dict(HUB_SPEC, weights=path), 4, (16, 16, 3))
    np.testing.assert_array_equal(loaded.get_layer(conv.name).kernel.numpy(), conv.kernel.numpy())
    tf.keras.utils.set_random_seed(2)
    fresh = build_model(HUB_SPEC, 4, (16, 16, 3))
    assert not np.array_equal(fresh.get_layer(conv.name).kernel.numpy(), conv.kernel.numpy())


@needs_keras3
@pytest.mark.parametrize("change, expected", [
    ({"backbone": "ResNet1000Backbone"}, "model.backbone='ResNet1000Backbone' is not a keras-hub image backbone "
                                         "class; valid choices: ["),
    ({"backbone": "GemmaBackbone"}, "is not a keras-hub image backbone class"),
    ({"weights": "/no/such.weights.h5"}, "model.weights='/no/such.weights.h5' is not a file"),
    ({"backbone_args": dict(HUB_ARGS, weights="imagenet")}, "model.backbone_args.weights is not supported"),
    ({"batchnorm": "drop"}, "model.batchnorm='drop' is not one of"),
    ({"preset": "resnet_50_imagenet"}, "model.preset is not a valid key for model.name='keras_hub'"),
])
def test_keras_hub_bad_choices_are_one_line_before_building(change, expected):
    assert expected in _one_line_error(dict(HUB_SPEC, **change))


@needs_keras3
@pytest.mark.parametrize("change, expected", [
    ({"backbone_args": dict(HUB_ARGS, image_shape=[32, 32, 3])},
     "model.backbone_args.image_shape=[32, 32, 3] disagrees with the data's [16, 16, 3]"),
    ({"backbone_args": dict(HUB_ARGS, stackwise_num_filters=[8, 16])}, "model.backbone_args do not fit ResNetBackbone"),
    ({"backbone_args": {"input_conv_filters": [64]}}, "model.backbone_args do not fit ResNetBackbone"),
])
def test_keras_hub_arguments_that_do_not_fit_are_one_line(change, expected, tmp_path):
    assert expected in _one_line_error(dict(HUB_SPEC, **change), 3, (16, 16, 3))


@needs_keras3
def test_keras_hub_weights_of_another_backbone_are_one_line(tmp_path):
    import keras_hub

    other = keras_hub.models.ResNetBackbone(image_shape=(16, 16, 3), **dict(HUB_ARGS, stackwise_num_blocks=[2, 1]))
    path = str(tmp_path / "other.weights.h5")
    other.save_weights(path)
    assert "does not fit this backbone" in _one_line_error(dict(HUB_SPEC, weights=path), 3, (16, 16, 3))


@needs_keras3
def test_sparta_train_fine_tunes_a_keras_hub_backbone_and_serves_it(tmp_path):
    from trainers import run
    from trainers.config import validate

    config = validate({
        "data": {"source": "synthetic", "num_examples": 64, "num_classes": 2, "image_size": [16, 16],
                 "val_fraction": 0.1, "test_fraction": 0.2},
        "model": HUB_SPEC,
        "method": {"name": "sparta", "density": 0.25, "warmup_epochs": 1},
        "privacy": {"target_epsilon": 8.0, "delta": 1e-3},
        "training": {"epochs": 3, "batch_size": 16, "learning_rate": 0.05, "seed": 0},
        "output_dir": str(tmp_path / "run"),
    })
    results = run.train(config)
    assert results["epsilon"] <= 8.0 + 1e-6 and 0 < results["trainable_fraction"] < 1
    served = tf.saved_model.load(results["export_dir"]).signatures["serving_default"]
    probabilities = served(images=tf.zeros((3, 16, 16, 3)))["probabilities"].numpy()
    assert probabilities.shape == (3, 2)
    np.testing.assert_allclose(probabilities.sum(axis=-1), 1.0, atol=1e-5)


# ------------------------------------------------------ Keras 3 .keras files


def _batchnorm_model():
    """A functional model with BatchNorm at the top level and inside a nested functional block."""
    inner_in = tf.keras.Input((6, 6, 4))
    inner = tf.keras.layers.Conv2D(8, 3, padding="same", name="inner_conv")(inner_in)
    inner = tf.keras.layers.BatchNormalization(name="inner_bn")(inner)
    block = tf.keras.Model(inner_in, tf.keras.layers.ReLU()(inner), name="block")
    inputs = tf.keras.Input((6, 6, 3))
    x = tf.keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    x = tf.keras.layers.BatchNormalization(name="bn")(x)
    x = block(x)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(3, name=HEAD_LAYER_NAME)(x))


@needs_keras3
def test_a_keras3_keras_file_with_batchnorm_is_a_saved_model_source(tmp_path):
    tf.keras.utils.set_random_seed(0)
    model = _batchnorm_model()
    path = str(tmp_path / "bn.keras")
    model.save(path)
    message = _one_line_error({"name": "saved", "path": path}, 5, (6, 6, 3))
    assert "BatchNormalization 'bn'" in message and "batchnorm='groupnorm' or 'freeze'" in message

    built = build_model({"name": "saved", "path": path, "batchnorm": "groupnorm"}, 5, (6, 6, 3))
    assert built.output_shape == (None, 5)
    classes = _layer_classes(built)
    assert "BatchNormalization" not in classes and classes.count("GroupNormalization") == 2
    assert isinstance(built.get_layer("bn"), tf.keras.layers.GroupNormalization)
    np.testing.assert_array_equal(built.get_layer("conv").kernel.numpy(), model.get_layer("conv").kernel.numpy())
    np.testing.assert_array_equal(built.get_layer("block").get_layer("inner_conv").kernel.numpy(),
                                  model.get_layer("block").get_layer("inner_conv").kernel.numpy())

    kept = build_model({"name": "saved", "path": path, "batchnorm": "freeze", "fresh_head": False}, 3, (6, 6, 3))
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 3)).astype(np.float32)
    np.testing.assert_allclose(kept(x).numpy(), model(x, training=False).numpy(), atol=1e-5)


@needs_keras3
def test_a_saved_keras_hub_backbone_loads_in_a_process_that_never_imported_keras_hub(tmp_path):
    import keras_hub

    backbone = keras_hub.models.ResNetBackbone(image_shape=(16, 16, 3), **HUB_ARGS)
    path = str(tmp_path / "hub.keras")
    backbone.save(path)  # its config names keras_hub classes, registered only once keras_hub is imported
    script = ("import json, sys\n"
              "from sparta_tf.models import build_model\n"
              "assert 'keras_hub' not in sys.modules\n"
              "m = build_model({'name': 'saved', 'path': sys.argv[1], 'batchnorm': 'groupnorm'}, 4, (16, 16, 3))\n"
              "print(json.dumps([list(m.output_shape), 'keras_hub' in sys.modules]))\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [[None, 4], True]


@needs_keras3
def test_a_savedmodel_directory_is_refused_on_keras3_in_one_line(tmp_path):
    module = tf.Module()
    module.v = tf.Variable(1.0)
    tf.saved_model.save(module, str(tmp_path / "sm"))
    message = _one_line_error({"name": "saved", "path": str(tmp_path / "sm")}, 3, (6, 6, 3))
    assert "Keras 3 cannot load" in message and ".keras" in message
