"""Grouped convolutions: the materialising engines' per-example gradients are exact and a DP fit with
``engine="vectorized"`` runs, with oneDNN off and on (issue 53 item 9).

TensorFlow reads ``TF_ENABLE_ONEDNN_OPTS`` when it is imported, and this session's conftest turns
oneDNN on, so the oneDNN-off checks run in a fresh interpreter with ``TF_ENABLE_ONEDNN_OPTS=0``
(what a library user gets by default on a CPU without AVX-512), which imports this module and runs
:func:`run_checks`. Before the fix the vectorized engine failed there inside TensorFlow
("filter_size does not have enough elements" for Conv1D / Conv2D), and a grouped Conv3D failed
with oneDNN on too.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf.per_example import make_engine
from small_models import LOSS, gaussian_data, per_example_loss, tape_gradients

ROOT = Path(__file__).resolve().parent.parent
L = tf.keras.layers
ENGINES = ("vectorized", "layerwise")
CASES = {  # name: (input shape, the grouped convolution)
    "conv2d_same_relu": ((5, 5, 4), lambda: L.Conv2D(6, 3, groups=2, padding="same", activation="relu")),
    "conv2d_strided": ((7, 7, 6), lambda: L.Conv2D(6, 2, groups=3, strides=2, use_bias=False)),
    "conv2d_dilated_valid": ((6, 6, 4), lambda: L.Conv2D(4, 2, groups=4, dilation_rate=2)),
    "conv1d_causal": ((7, 4), lambda: L.Conv1D(4, 3, groups=2, padding="causal", dilation_rate=2)),
    "conv1d_strided": ((7, 4), lambda: L.Conv1D(6, 3, groups=2, strides=2)),
    "conv3d_same": ((4, 4, 3, 4), lambda: L.Conv3D(4, 2, groups=2, padding="same", activation="tanh")),
}
APIS = ("make_private", "DPModel")


def model_for(case: str, seed: int = 0) -> tf.keras.Model:
    """The case's grouped convolution, flattened, then a 3-way Dense head; seeded."""
    shape, conv = CASES[case]
    tf.keras.utils.set_random_seed(seed)
    inputs = L.Input(shape)
    return tf.keras.Model(inputs, L.Dense(3)(L.Flatten()(conv()(inputs))))


def _failure(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def gradient_checks(case: str) -> dict:
    """Per engine: the largest per-example gradient error against the one-example tape, relative to
    the largest coordinate (or the error it raised); ``plain_call``: how far the model's own call
    moved after the engines ran (0: their hooks are inert outside their pass)."""
    model = model_for(case)
    x, y = gaussian_data(4, CASES[case][0], 3, seed=1)
    want = tape_gradients(model, x, y)
    scale = max(float(np.max(np.abs(w))) for w in want)
    before = model(x).numpy()
    results = {}
    for engine_name in ENGINES:
        engine = make_engine(model, model.trainable_variables, engine_name, materialise=True)
        step = tf.function(lambda: engine(tf.constant(x), tf.constant(y), per_example_loss, tf.ones([4], bool)))
        try:
            got = [g.numpy() for g in step().grads]
            results[engine_name] = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want)) / scale
        except Exception as error:  # noqa: BLE001  (reported, then asserted on)
            results[engine_name] = _failure(error)
    results["plain_call"] = float(np.max(np.abs(model(x).numpy() - before)))
    return results


def fit_check(api: str) -> dict | str:
    """One epoch of 4 Poisson steps with ``engine="vectorized"`` on the grouped Conv2D model."""
    model = model_for("conv2d_same_relu", seed=3)
    x, y = gaussian_data(32, CASES["conv2d_same_relu"][0], 3, seed=2)
    start = [v.numpy().copy() for v in model.trainable_variables]
    if api == "make_private":
        dp = sparta_tf.make_private(model, method="all", target_epsilon=8.0, delta=1e-5, epochs=1, batch_size=8,
                                    dataset_size=32, seed=0, engine="vectorized")
    else:
        dp = sparta_tf.DPModel(model, noise_multiplier=1.0, sample_rate=0.25, dataset_size=32, seed=0,
                               engine="vectorized")
    dp.compile(tf.keras.optimizers.SGD(0.1), loss=LOSS)
    try:
        dp.fit(x, y, epochs=1, verbose=0)
    except Exception as error:  # noqa: BLE001
        return _failure(error)
    return {"moved": any(not np.array_equal(a, v.numpy()) for a, v in zip(start, model.trainable_variables)),
            "finite": all(bool(np.all(np.isfinite(v.numpy()))) for v in model.trainable_variables)}


def run_checks() -> dict:
    """Every check, with the oneDNN state they ran under (what the subprocess prints)."""
    from tensorflow.python.util import _pywrap_util_port

    return {"onednn": bool(_pywrap_util_port.IsMklEnabled()), "gradients": {case: gradient_checks(case) for case in CASES},
            "fit": {api: fit_check(api) for api in APIS}}


@pytest.fixture(scope="module")
def onednn_off():
    """:func:`run_checks` in a fresh interpreter with ``TF_ENABLE_ONEDNN_OPTS=0``."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    code = "import json, test_grouped_conv_engines as t; print('RESULTS ' + json.dumps(t.run_checks()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULTS "):])
    assert results["onednn"] is False
    return results


def _assert_exact(error, case: str, engine: str) -> None:
    assert isinstance(error, float), f"{case} {engine}: {error}"
    assert error < 1e-5, f"{case} {engine}: relative error {error:.2e}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_conv_per_example_gradients_match_the_tape_with_onednn_off(onednn_off, case, engine):
    _assert_exact(onednn_off["gradients"][case][engine], case, engine)
    assert onednn_off["gradients"][case]["plain_call"] == 0.0


@pytest.mark.parametrize("api", APIS)
def test_a_vectorized_dp_fit_with_grouped_conv_runs_with_onednn_off(onednn_off, api):
    fit = onednn_off["fit"][api]
    assert isinstance(fit, dict), fit
    assert fit["moved"] and fit["finite"], fit


@pytest.mark.parametrize("case", ["conv2d_same_relu", "conv1d_causal", "conv3d_same"])
def test_grouped_conv_per_example_gradients_match_the_tape_in_this_session(case):
    """This session's oneDNN (on, from conftest, unless set): Conv1D / Conv2D run TensorFlow's own
    grouped op, Conv3D the block-diagonal one."""
    results = gradient_checks(case)
    for engine in ENGINES:
        _assert_exact(results[engine], case, engine)
    assert results["plain_call"] == 0.0
