"""Serving export: a fresh process reproduces the model; the signature; no DP machinery inside."""

import collections
import os
import pathlib
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

import sparta_tf.export as export_module
from sparta_tf import DPModel, random_layer_state
from sparta_tf.export import export_for_serving
from sparta_tf.tuning.release import export_in_fresh_process
from sparta_tf.models import cifar_resnet_gn
from sparta_tf.per_example.recording import _HOOK_ATTRIBUTE, recording

SHAPE = (8, 8, 3)
SAVED_MODEL_CLI = pathlib.Path(sys.executable).with_name("saved_model_cli")

# Runs in a fresh interpreter that cannot import sparta_tf: the export must be self-contained.
LOAD_AND_PREDICT = """
import sys
sys.modules["sparta_tf"] = None
import numpy as np, tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
out = serve(images=tf.constant(np.load(sys.argv[2])))
np.savez(sys.argv[3], probabilities=out["probabilities"].numpy(), classes=out["classes"].numpy())
"""


def _env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")


@pytest.fixture(scope="module")
def trained():
    """A tiny GroupNorm ResNet after 4 DP-SGD steps (so per-example hooks are installed)."""
    tf.keras.utils.set_random_seed(0)
    model = cifar_resnet_gn(depth=8, width=4, input_shape=SHAPE, num_classes=3)
    rng = np.random.RandomState(0)
    x = rng.rand(32, *SHAPE).astype(np.float32)
    y = rng.randint(0, 3, 32)
    dp = DPModel(model, noise_multiplier=0.5, sample_rate=0.25, physical_batch_size=16, seed=1)
    dp.compile(tf.keras.optimizers.SGD(0.5), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dp.fit(x, y, epochs=1, verbose=0)
    assert any(getattr(l, _HOOK_ATTRIBUTE, None) is not None for l in model.layers)
    return dp, model


@pytest.fixture(scope="module")
def images():
    return np.random.RandomState(1).rand(5, *SHAPE).astype(np.float32)


def test_fresh_process_reproduces_predictions(trained, images, tmp_path):
    _, model = trained
    path = export_for_serving(model, str(tmp_path / "export"))
    assert path == str(tmp_path / "export" / "1")
    np.save(tmp_path / "x.npy", images)
    subprocess.run(
        [sys.executable, "-c", LOAD_AND_PREDICT, path, str(tmp_path / "x.npy"), str(tmp_path / "out.npz")],
        check=True, env=_env(), timeout=120,
    )
    out = np.load(tmp_path / "out.npz")
    expected = tf.nn.softmax(model(images, training=False)).numpy()
    np.testing.assert_allclose(out["probabilities"], expected, atol=1e-5)
    np.testing.assert_array_equal(out["classes"], expected.argmax(-1))

    cli = subprocess.run(
        [str(SAVED_MODEL_CLI), "show", "--dir", path, "--tag_set", "serve", "--signature_def", "serving_default"],
        check=True, env=_env(), capture_output=True, text=True, timeout=120,
    ).stdout
    inputs, outputs = cli.split("following output(s)")
    assert "inputs['images']" in inputs and "DT_FLOAT" in inputs and "(-1, 8, 8, 3)" in inputs
    probabilities = outputs.split("outputs['probabilities']")[1]
    assert "DT_FLOAT" in probabilities and "(-1, 3)" in probabilities
    assert "outputs['classes']" in outputs


def _graph_ops_and_bytes(path):
    """(multiset of op types over the graph and every function, raw saved_model.pb)."""
    raw = pathlib.Path(path, "saved_model.pb").read_bytes()
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString(raw)
    ops = collections.Counter()
    for graph in saved.meta_graphs:
        ops.update(node.op for node in graph.graph_def.node)
        for function in graph.graph_def.library.function:
            ops.update(node.op for node in function.node_def)
    return ops, raw


def test_dp_wrapped_export_has_no_per_example_machinery(trained, images, tmp_path):
    dp, model = trained
    path = export_for_serving(dp, str(tmp_path / "export"), version=7)
    assert os.path.basename(path) == "7"
    ops, raw = _graph_ops_and_bytes(path)
    # Per-example probes add `zeros_like(output)` to layer outputs, vectorized_map leaves
    # loops, DP noise is random: the served graph must be op-for-op that of the same
    # architecture never wrapped, hooked or trained.
    plain = export_for_serving(
        cifar_resnet_gn(depth=8, width=4, input_shape=SHAPE, num_classes=3), str(tmp_path / "plain"))
    assert ops == _graph_ops_and_bytes(plain)[0]
    assert not set(ops) & {"While", "StatelessWhile", "TensorListReserve", "StatelessRandomNormalV3"}
    # Negative control: the hooked instance traced inside a recording pass does show its probes.
    with mock.patch.object(export_module, "_clean_copy", lambda m: m), tf.GradientTape() as tape:
        with recording(tape, [l for l in model.layers if getattr(l, _HOOK_ATTRIBUTE, None)]):
            leaked = export_for_serving(model, str(tmp_path / "leaked"))
    assert (_graph_ops_and_bytes(leaked)[0] - ops)["ZerosLike"] > 0
    for marker in (b"dp_step", b"noise_seed", b"DPModel", b"sparta", b"dp_" + model.name.encode()):
        assert marker not in raw
    loaded = tf.saved_model.load(path)
    assert len(loaded.model_variables) == len(model.weights)
    out = loaded.signatures["serving_default"](images=tf.constant(images))
    np.testing.assert_allclose(out["probabilities"].numpy(), tf.nn.softmax(dp(images)).numpy(), atol=1e-5)


def test_versions_preprocessing_and_atomic_layout(trained, images, tmp_path):
    _, model = trained
    base = tmp_path / "export"
    mean, std = [0.5, 0.4, 0.3], 0.25
    first = export_for_serving(model, str(base), preprocessing={"mean": mean, "std": std}, include_classes=False)
    second = export_for_serving(model, str(base))
    assert [os.path.basename(first), os.path.basename(second)] == ["1", "2"]
    with pytest.raises(FileExistsError):
        export_for_serving(model, str(base), version=2)
    with pytest.raises(ValueError, match="preprocessing.scale"):
        export_for_serving(model, str(base), preprocessing={"scale": 2.0})
    assert sorted(os.listdir(base)) == ["1", "2"]  # no temporary directories left behind
    out = tf.saved_model.load(first).signatures["serving_default"](images=tf.constant(images))
    assert set(out) == {"probabilities"}
    expected = tf.nn.softmax(model((images - np.array(mean, np.float32)) / std)).numpy()
    np.testing.assert_allclose(out["probabilities"].numpy(), expected, atol=1e-5)


def test_an_export_in_a_fresh_process_counts_nothing_this_process_traced(trained, images, tmp_path):
    """sparta-train exports by a fresh process: a SavedModel names its functions from a process-wide counter,
    which here would count the traces the training ran (data-dependent batch shapes, evaluations)."""
    _, model = trained
    first = export_in_fresh_process(model, str(tmp_path / "a"), version=1)
    for size in (3, 5, 7):  # more traces in this process
        tf.function(lambda x: model(x, training=False)).get_concrete_function(
            tf.TensorSpec([size, *images.shape[1:]], tf.float32))
    second = export_in_fresh_process(model, str(tmp_path / "b"), version=1)
    assert pathlib.Path(first, "saved_model.pb").read_bytes() == pathlib.Path(second, "saved_model.pb").read_bytes()
    assert os.path.basename(first) == "1" and not [p for p in os.listdir(tmp_path / "a") if p.startswith(".")]
    out = tf.saved_model.load(first).signatures["serving_default"](images=tf.constant(images))
    np.testing.assert_allclose(out["probabilities"].numpy(), tf.nn.softmax(model(images, training=False)).numpy(),
                               atol=1e-5)
    with pytest.raises(FileExistsError, match="already exists"):
        export_in_fresh_process(model, str(tmp_path / "a"), version=1)


def _saved_values(path):
    reader = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if "OBJECT_GRAPH" not in k}


def test_the_dp_models_export_holds_no_dp_state_and_a_savedmodel_of_the_dp_model_is_refused(tmp_path):
    """``dp.export`` writes the wrapped model only, its random layers' draw counters (one per micro-batch of
    every step: a count of the Poisson batches) at zero; ``tf.saved_model.save(dp)``, which would write the
    secret noise seed and the loss trackers' example counts, is refused."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dropout(0.5), tf.keras.layers.Dense(3, name="head")])
    rng = np.random.RandomState(0)
    x, y = rng.rand(40, 6).astype(np.float32), rng.randint(0, 3, 40)
    dp = DPModel(model, noise_multiplier=1.0, sample_rate=0.25, physical_batch_size=2)  # secret seeds
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dp.fit(x, y, epochs=1, verbose=0)
    counters = [v.numpy().copy() for v in random_layer_state.random_states(model)]
    assert all(c[-1] > 1 for c in counters)  # Keras 3's Dropout counts its draws (Keras 2's keeps no state)
    dp.export(str(tmp_path / "export"))
    saved = _saved_values(str(tmp_path / "export"))
    integers = {int(i) for v in saved.values() if np.asarray(v).dtype.kind in "iu" for i in np.ravel(v)}
    assert not integers & {dp.seed, dp.public_seed}
    exported_states = [v for v in tf.saved_model.load(str(tmp_path / "export")).variables
                       if any(name in v.name for name in random_layer_state.RANDOM_STATE_NAMES)]
    assert len(exported_states) == len(counters) and not any(np.any(v.numpy()) for v in exported_states)
    for counter, variable in zip(counters, random_layer_state.random_states(model)):  # put back after the export
        np.testing.assert_array_equal(counter, variable.numpy())
    with pytest.raises(ValueError, match="would hold the run's secret noise seed"):
        tf.saved_model.save(dp, str(tmp_path / "whole"))
