"""Fast structural tests of the GroupNorm ResNets (and their PyTorch twin)."""

import importlib.util
import pathlib

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.models import (
    HEAD_LAYER_NAME,
    cifar_resnet_gn,
    resnet18_gn,
    resnet20_gn,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def r20():
    tf.keras.utils.set_random_seed(0)
    return resnet20_gn()


def _norm_layers(model):
    return [l for l in model.layers if "normalization" in type(l).__name__.lower()]


def test_resnet20_param_count(r20):
    # 268,352 conv + 1,376 GroupNorm + 650 head (He et al.: 0.27M).
    assert r20.count_params() == 269_722
    assert 0.26e6 < r20.count_params() < 0.28e6


def test_resnet20_option_b_adds_projections():
    m = resnet20_gn(shortcut="B")
    assert m.count_params() == 269_722 + 16 * 32 + 32 * 64 + 2 * (32 + 64)  # 272,474
    assert m.get_layer("stage2_block1_shortcut_conv").kernel.shape == (1, 1, 16, 32)


def test_resnet20_output_shape(r20):
    y = r20(np.zeros((3, 32, 32, 3), np.float32), training=True)
    assert y.shape == (3, 10)
    m = resnet20_gn(input_shape=(28, 28, 1), num_classes=7)
    assert m(np.zeros((2, 28, 28, 1), np.float32)).shape == (2, 7)


def test_resnet20_structure(r20):
    convs = [l for l in r20.layers if isinstance(l, tf.keras.layers.Conv2D)]
    assert len(convs) == 19  # + the head = 20 weighted layers
    assert [l.filters for l in convs[:1]] == [16]
    assert sorted({l.filters for l in convs}) == [16, 32, 64]
    assert all(not l.use_bias for l in convs)
    gns = [l for l in r20.layers if isinstance(l, tf.keras.layers.GroupNormalization)]
    assert len(gns) == 19
    # Default groups: gcd(32, channels) (Opacus' BatchNorm -> GroupNorm rule).
    assert {(l.gamma.shape[0], l.groups) for l in gns} == {(16, 16), (32, 32), (64, 32)}


@pytest.mark.parametrize("build", [resnet20_gn, resnet18_gn, lambda: resnet20_gn(shortcut="B")])
def test_no_batchnorm_and_head_named(build):
    model = build()
    assert not any(
        isinstance(l, tf.keras.layers.BatchNormalization) or "batchnorm" in type(l).__name__.lower()
        for l in model.layers
    )
    assert all(isinstance(l, tf.keras.layers.GroupNormalization) for l in _norm_layers(model))
    head = model.get_layer(HEAD_LAYER_NAME)
    assert HEAD_LAYER_NAME == "head"
    assert isinstance(head, tf.keras.layers.Dense)
    assert head is model.layers[-1]
    assert head.activation is tf.keras.activations.linear  # logits
    assert [l.name for l in model.layers if isinstance(l, tf.keras.layers.Dense)] == ["head"]
    names = [l.name for l in model.layers]
    assert len(names) == len(set(names))


def test_resnet18_params_and_shape():
    m = resnet18_gn(num_classes=100)
    # torchvision resnet18 with a 3x3 stem and a 100-way head: 11.22M.
    assert 11.1e6 < m.count_params() < 11.3e6
    assert m.get_layer("stem_conv").kernel.shape == (3, 3, 3, 64)
    assert m.get_layer("stage4_block2_conv2").kernel.shape == (3, 3, 512, 512)
    assert m.get_layer(HEAD_LAYER_NAME).kernel.shape == (512, 100)
    assert m(np.zeros((1, 32, 32, 3), np.float32)).shape == (1, 100)


def test_groups_validation():
    assert resnet20_gn(groups=4).get_layer("stem_gn").groups == 4
    assert resnet20_gn(groups=lambda c: c // 4).get_layer("stage3_block3_gn2").groups == 16
    with pytest.raises(ValueError, match="groups"):
        resnet20_gn(groups=3)
    with pytest.raises(ValueError, match="6n\\+2"):
        cifar_resnet_gn(depth=21)


def test_save_load_roundtrip(r20, tmp_path):
    path = tmp_path / "r20.keras"
    r20.save(path)
    loaded = tf.keras.models.load_model(path)
    x = np.random.RandomState(1).rand(2, 32, 32, 3).astype(np.float32)
    np.testing.assert_allclose(loaded(x).numpy(), r20(x).numpy(), atol=1e-6)


def _torch_twin():
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("torch_resnet", REPO / "benchmarks" / "torch_resnet.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shortcut,groups", [("A", None), ("B", 4)])
def test_torch_twin_matches_keras(shortcut, groups):
    torch = pytest.importorskip("torch")

    tr = _torch_twin()
    tf.keras.utils.set_random_seed(2)
    km = resnet20_gn(shortcut=shortcut, groups=groups)
    tm = tr.load_keras_weights(tr.resnet20_gn(shortcut=shortcut, groups=groups), km)
    assert sum(p.numel() for p in tm.parameters()) == km.count_params()
    x = np.random.RandomState(3).randn(4, 32, 32, 3).astype(np.float32)
    with torch.no_grad():
        yt = tm(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
    np.testing.assert_allclose(yt, km(x).numpy(), atol=2e-5, rtol=1e-4)


def test_torch_resnet18_twin_param_count():
    tr = _torch_twin()
    tm = tr.resnet18_gn(num_classes=100)
    assert sum(p.numel() for p in tm.parameters()) == resnet18_gn(num_classes=100).count_params()
