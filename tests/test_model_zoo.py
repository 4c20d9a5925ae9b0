"""Model zoo: WRN/ViT backbones, BatchNorm conversion, fresh heads, YAML specs."""

import collections

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf.backend import variable_key
from sparta_tf.groups import parameter_table
from sparta_tf.models import (
    HEAD_LAYER_NAME,
    MODEL_REGISTRY,
    build_model,
    replace_batchnorm,
    validate_model_spec,
    vit_tiny,
    with_fresh_head,
    wrn_gn,
)
from sparta_tf.per_example import LayerwiseEngine, make_engine

TINY_VIT = dict(patch_size=4, dim=16, depth=2, heads=2, mlp_dim=32)
KERAS_CV_ARGS = dict(stackwise_filters=[8, 16], stackwise_blocks=[2, 2], stackwise_strides=[1, 2])


def _has_batchnorm(model):
    return any(
        isinstance(l, tf.keras.layers.BatchNormalization)
        for l in model._flatten_layers(include_self=False, recursive=True)
    )


def _check_classifier(model, num_classes):
    head = model.get_layer(HEAD_LAYER_NAME)
    assert isinstance(head, tf.keras.layers.Dense) and head is model.layers[-1]
    assert head.activation is tf.keras.activations.linear
    assert head.units == num_classes
    assert not _has_batchnorm(model)
    names = [l.name for l in model.layers]
    assert len(names) == len(set(names))


# ------------------------------------------------------------------ builders


@pytest.mark.parametrize(
    "spec,params",
    [
        ({"name": "resnet20_gn"}, 269_722),
        ({"name": "wrn16_4_gn"}, 2_748_890),  # 2,742,704 conv + 3,616 GN + 2,570 head (paper: 2.7M)
        ({"name": "vit_tiny"}, 5_362_762),  # DeiT-tiny width/depth on 32x32, patch 4 (65 tokens)
        ({"name": "resnet18_gn"}, None),
    ],
)
def test_registry_builds_each_model(spec, params):
    model = build_model(spec, num_classes=10, input_shape=(32, 32, 3))
    _check_classifier(model, 10)
    if params is not None:
        assert model.count_params() == params
    else:
        assert 11.1e6 < model.count_params() < 11.3e6
    assert model(np.zeros((1, 32, 32, 3), np.float32)).shape == (1, 10)


def test_spec_args_pass_through():
    m = build_model({"name": "wrn16_4_gn", "groups": 8, "dropout_rate": 0.3}, 7, [16, 16, 3])
    assert m.get_layer("stage3_block2_gn2").groups == 8
    assert m.get_layer("stage1_block1_dropout").rate == 0.3
    assert m.output_shape == (None, 7)
    v = build_model({"name": "vit_tiny", "args": TINY_VIT}, 3, (8, 8, 3))
    assert v.get_layer("pos_embed").embedding.shape == (1, 5, 16)
    assert {"resnet20_gn", "resnet18_gn", "wrn16_4_gn", "vit_tiny", "keras_cv", "saved"} <= set(MODEL_REGISTRY)


@pytest.mark.parametrize(
    "spec,match",
    [
        ({"name": "resnet50"}, r"model\.name='resnet50' is unknown; valid choices: \[.*'vit_tiny'"),
        ({"depth": 16}, r"model\.name is required"),
        ({"name": "resnet20_gn", "depht": 3}, r"model\.depht is not a valid key .*valid choices: \[.*'groups'"),
        ({"name": "wrn16_4_gn", "depth": 28}, r"model\.depth is not a valid key"),
        ({"name": "vit_tiny", "num_classes": 3}, r"model\.num_classes is not allowed"),
        ({"name": "vit_tiny", "dim": 8, "args": {"dim": 8}}, r"model\.dim is given both"),
        ({"name": "keras_cv"}, r"model\.backbone is required"),
        ({"name": "keras_cv", "backbone": "ResNetBackbone", "batchnorm": "drop"}, r"model\.batchnorm='drop'"),
        ({"name": "saved"}, r"model\.path is required"),
    ],
)
def test_spec_errors_are_one_line(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        validate_model_spec(spec)
    assert "\n" not in str(info.value)


def test_wrn_structure():
    m = wrn_gn(depth=16, width=4)
    assert m.name == "wrn16_4_gn"
    convs = [l for l in m.layers if isinstance(l, tf.keras.layers.Conv2D)]
    # stem + 6n block convs + 3 projection shortcuts (16->64, 64->128, 128->256).
    assert len(convs) == 1 + 12 + 3 and all(not c.use_bias for c in convs)
    assert [l.name for l in convs if "shortcut" in l.name] == [
        "stage1_block1_shortcut_conv", "stage2_block1_shortcut_conv", "stage3_block1_shortcut_conv"]
    assert m.get_layer("stage2_block1_conv1").strides == (2, 2)
    assert m.get_layer("stage2_block1_shortcut_conv").strides == (2, 2)
    # Pre-activation: the projection reads relu(GN(x)), like conv1.
    assert m.get_layer("stage2_block1_shortcut_conv").input is m.get_layer("stage2_block1_relu1").output
    assert m.get_layer("stage1_block1_gn1").groups == 16  # gcd(32, 16) on the stem output
    assert m.get_layer("final_gn").groups == 32
    assert m.get_layer(HEAD_LAYER_NAME).kernel.shape == (256, 10)
    with pytest.raises(ValueError, match="6n\\+4"):
        wrn_gn(depth=18)


# ----------------------------------------------------------------------- ViT


def test_vit_roles_and_per_example_grads_match_tape():
    tf.keras.utils.set_random_seed(0)
    model = vit_tiny(num_classes=3, input_shape=(8, 8, 3), **TINY_VIT)
    roles = {variable_key(p.variable).removesuffix(":0"): p.role for p in parameter_table(model)}
    assert roles["cls_token/token"] == roles["pos_embed/embedding"] == "other"
    assert roles["block1_attn/query/kernel"] == "kernel"  # EinsumDense projections are maskable
    assert roles["block2_attn/attention_output/kernel"] == "kernel"
    assert roles["block1_ln1/gamma"] == "norm" and roles["head/kernel"] == "head"
    assert collections.Counter(roles.values())["other"] == 2

    engine = make_engine(model, model.trainable_variables, "auto", materialise=True)
    assert isinstance(engine, LayerwiseEngine)  # class token / position embedding are leaf-layer weights

    def loss_fn(y, logits):
        return tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)

    x = np.random.RandomState(1).randn(2, 8, 8, 3).astype(np.float32)
    y = np.array([0, 2])
    result = engine(tf.constant(x), tf.constant(y), loss_fn, tf.constant([True, True]))
    for i in range(2):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i : i + 1], model(x[i : i + 1], training=True))[0]
        expected = tape.gradient(loss, model.trainable_variables)
        np.testing.assert_allclose(result.losses[i].numpy(), loss.numpy(), rtol=1e-6)
        for v, g, per_example in zip(model.trainable_variables, expected, result.grads):
            np.testing.assert_allclose(per_example[i].numpy(), g.numpy(), atol=1e-5, err_msg=v.name)


# ------------------------------------------------------------- keras-cv / BN


@pytest.fixture(scope="module")
def keras_cv_models():
    keras_cv = pytest.importorskip(
        "keras_cv", reason="keras-cv is installed on the TF 2.15 line only (model.name=keras_hub is the Keras 3 choice)")
    return keras_cv.models


def _small_backbone(keras_cv_models):
    # Note: keras-cv 0.9 ResNetV2 stacks need >= 2 blocks (one block duplicates layer names).
    return keras_cv_models.ResNetV2Backbone(
        **KERAS_CV_ARGS, include_rescaling=False, input_shape=(32, 32, 3)
    )


def test_replace_batchnorm_groupnorm(keras_cv_models):
    tf.keras.utils.set_random_seed(0)
    backbone = _small_backbone(keras_cv_models)
    bns = [l for l in backbone.layers if isinstance(l, tf.keras.layers.BatchNormalization)]
    assert bns
    converted = replace_batchnorm(backbone, "groupnorm")
    assert converted is not backbone and not _has_batchnorm(converted)
    assert _has_batchnorm(backbone)  # the original is untouched
    for bn in bns:
        gn = converted.get_layer(bn.name)
        assert isinstance(gn, tf.keras.layers.GroupNormalization)
        channels = bn.gamma.shape[0]
        assert gn.groups == np.gcd(32, channels) and gn.epsilon == bn.epsilon
    for name in ("conv1_conv", "v2_stack_1_block2_3_conv"):
        np.testing.assert_array_equal(converted.get_layer(name).kernel.numpy(), backbone.get_layer(name).kernel.numpy())
    x = np.random.RandomState(0).rand(2, 32, 32, 3).astype(np.float32)
    assert converted(x).shape == backbone(x).shape


def test_replace_batchnorm_freeze_and_dpmodel(keras_cv_models):
    backbone = _small_backbone(keras_cv_models)
    pooled = tf.keras.layers.GlobalAveragePooling2D()(backbone.output)
    model = tf.keras.Model(backbone.input, tf.keras.layers.Dense(3, name="head")(pooled))
    with pytest.raises(sparta_tf.NotPerExampleSafeError, match="BatchNormalization"):
        sparta_tf.DPModel(model, noise_multiplier=1.0, sample_rate=0.1)
    frozen = replace_batchnorm(model, "freeze")
    assert frozen is model
    assert all(
        not l.trainable for l in model.layers if isinstance(l, tf.keras.layers.BatchNormalization)
    )
    x = np.random.RandomState(0).rand(2, 32, 32, 3).astype(np.float32)
    np.testing.assert_allclose(model(x, training=True).numpy(), model(x, training=False).numpy(), atol=1e-6)
    sparta_tf.DPModel(model, noise_multiplier=1.0, sample_rate=0.1)  # accepted now


def test_build_keras_cv_spec(keras_cv_models):
    spec = {"name": "keras_cv", "backbone": "ResNetV2Backbone", "backbone_args": KERAS_CV_ARGS}
    model = build_model(spec, num_classes=4, input_shape=(32, 32, 3))
    _check_classifier(model, 4)
    assert model.get_layer("pool").output_shape == (None, 64)
    sparta_tf.DPModel(model, noise_multiplier=1.0, sample_rate=0.1)
    frozen = build_model(dict(spec, batchnorm="freeze"), num_classes=4, input_shape=(32, 32, 3))
    assert _has_batchnorm(frozen) and not any(
        l.trainable for l in frozen.layers if isinstance(l, tf.keras.layers.BatchNormalization))
    with pytest.raises(ValueError, match=r"model\.backbone='ResNet50V2Backbone' is not a keras-cv backbone class"):
        build_model(dict(spec, backbone="ResNet50V2Backbone"), 4, (32, 32, 3))  # a preset alias: never built


# -------------------------------------------------------- saved / fresh head


def test_with_fresh_head_from_keras_file(tmp_path):
    tf.keras.utils.set_random_seed(0)
    model = vit_tiny(num_classes=3, input_shape=(8, 8, 3), **TINY_VIT)
    path = tmp_path / "vit.keras"
    model.save(path)
    fresh = with_fresh_head(str(path), 5)
    _check_classifier(fresh, 5)
    assert fresh.get_layer(HEAD_LAYER_NAME).input is fresh.get_layer("cls_pool").output
    np.testing.assert_array_equal(fresh.get_layer("pos_embed").embedding.numpy(), model.get_layer("pos_embed").embedding.numpy())
    built = build_model({"name": "saved", "path": str(path)}, 5, (8, 8, 3))
    assert built.output_shape == (None, 5)
    kept = build_model({"name": "saved", "path": str(path), "fresh_head": False}, 3, (8, 8, 3))
    x = np.random.RandomState(0).rand(2, 8, 8, 3).astype(np.float32)
    np.testing.assert_allclose(kept(x).numpy(), model(x).numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="3 outputs for 5 classes"):
        build_model({"name": "saved", "path": str(path), "fresh_head": False}, 5, (8, 8, 3))


@pytest.mark.filterwarnings("ignore:You are saving your model as an HDF5 file")
def test_with_fresh_head_rejects_trainable_batchnorm(tmp_path):
    inputs = tf.keras.Input((4, 4, 2))
    x = tf.keras.layers.Conv2D(4, 3, name="conv")(inputs)
    x = tf.keras.layers.BatchNormalization(name="bn")(x)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(3)(x)
    x = tf.keras.layers.Softmax()(x)  # no layer named "head": the Dense before the softmax is the classifier
    path = tmp_path / "bn.h5"
    tf.keras.Model(inputs, x).save(path)
    with pytest.raises(ValueError, match=r"BatchNormalization 'bn' .*batchnorm='groupnorm' or 'freeze'") as info:
        with_fresh_head(path, 2)
    assert "\n" not in str(info.value)
    fresh = with_fresh_head(path, 2, batchnorm="groupnorm")
    _check_classifier(fresh, 2)
    assert fresh.get_layer(HEAD_LAYER_NAME).kernel.shape == (16, 2)
    assert isinstance(fresh.get_layer("bn"), tf.keras.layers.GroupNormalization)
