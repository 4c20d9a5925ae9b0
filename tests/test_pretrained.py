"""Shipped public pre-trained models: made by benchmarks/pretrain_public.py, loaded by name, checksum-checked."""

import json
import os
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

from sparta_tf.models import pretrained
from sparta_tf.models.zoo import build_model, validate_model_spec

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A tiny public model made by the real recipe (1 epoch, 128 examples) in a weights folder of its own."""
    if not (DATA / "mnist.npz").exists():
        pytest.skip(f"{DATA / 'mnist.npz'} is not available")
    import pretrain_public

    out = tmp_path_factory.mktemp("weights")
    card = pretrain_public.train_public("mnist-resnet20-gn", str(DATA), str(out / "work"), str(out), 1, 128)
    return out, card


def test_a_shipped_model_loads_by_name_with_a_fresh_head(shipped, monkeypatch):
    out, card = shipped
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", str(out))
    assert pretrained.available() == ["mnist-resnet20-gn"]
    assert card["sha256"] == pretrained.sha256(str(out / "mnist-resnet20-gn.weights.h5"))
    assert card["command"].startswith("python benchmarks/pretrain_public.py")
    public = pretrained.load_pretrained("mnist-resnet20-gn")
    model = build_model({"name": "pretrained", "weights": "mnist-resnet20-gn"}, 4, (28, 28, 1))
    assert model.output_shape[-1] == 4 and public.output_shape[-1] == 10
    conv = public.get_layer("stem_conv").kernel.numpy()
    assert np.array_equal(model.get_layer("stem_conv").kernel.numpy(), conv)  # the backbone is the public one


def test_a_tampered_or_unknown_model_is_refused(shipped, monkeypatch, tmp_path):
    out, _ = shipped
    copy = tmp_path / "weights"
    copy.mkdir()
    for name in os.listdir(out):
        if name.startswith("mnist"):
            (copy / name).write_bytes((out / name).read_bytes())
    monkeypatch.setattr(pretrained, "WEIGHTS_DIR", str(copy))
    with pytest.raises(ValueError, match="takes inputs \\[28, 28, 1\\], the data has \\[32, 32, 3\\]"):
        build_model({"name": "pretrained", "weights": "mnist-resnet20-gn"}, 4, (32, 32, 3))
    with pytest.raises(ValueError, match="is not a shipped pre-trained model"):
        validate_model_spec({"name": "pretrained", "weights": "imagenet"})
    weights = copy / "mnist-resnet20-gn.weights.h5"
    weights.write_bytes(weights.read_bytes()[:-16] + b"0" * 16)
    with pytest.raises(ValueError, match="do not match their recorded SHA-256"):
        pretrained.load_pretrained("mnist-resnet20-gn")


def test_every_committed_model_card_matches_its_weights():
    for name in pretrained.available():
        card = pretrained.card(name)
        path = os.path.join(pretrained.WEIGHTS_DIR, f"{name}.weights.h5")
        assert pretrained.sha256(path) == card["sha256"], name
        assert {"model", "input_shape", "num_classes", "command", "public_test_accuracy"} <= set(card)
        json.dumps(card)
