"""One source of truth for the mechanism: only the plan computes sigma (and only its rates module q), and what a DP model
charges is the one ``DpSgdMechanism`` its steps run.

The source rule (AST-based, over every module of ``sparta_tf/`` and ``trainers/``):

1. *sigma*: a call of a calibrator (:data:`CALIBRATORS`: every ``calibrate*`` function of
   :mod:`sparta_tf.privacy.calibration`, and dp-accounting's ``calibrate_dp_mechanism``) appears only
   in :data:`SIGMA_MODULES`: the plan, and the calibration module that implements the search (a
   caller without a plan asks the plan's functions, e.g. DP-FROST's ``compute_sigmas``);
2. *q*: a sample rate is computed (not passed on) only in :data:`Q_MODULES` (the rates the plan and
   the sampler read: ``q`` and cyclic Poisson sampling's ``b q``), where
   "computed" is any of

   * ``min(1, a / b)`` (``1`` or ``1.0``, either order): the clamped ``b / n``;
   * a division assigned to a name ``q`` / ``sample_rate`` / ``rate``, or passed as a keyword
     argument ``sample_rate=a / b``.

Every other module reads ``plan.sample_rate`` / ``plan.noise_multiplier`` or ``dp.mechanism``.
"""

from __future__ import annotations

import ast
import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import sparta_tf
from sparta_tf.methods import make_method
from sparta_tf.private_training import plan_method, private_model
from sparta_tf.privacy import calibration, charging
from sparta_tf.privacy.callbacks import PrivacyCallback
from sparta_tf.privacy.mechanism import DpSgdMechanism
from sparta_tf.privacy.plan import sample_rate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIGMA_MODULES = ("sparta_tf/privacy/plan.py", "sparta_tf/privacy/calibration.py")
Q_MODULES = ("sparta_tf/privacy/rates.py",)
RATE_NAMES = {"q", "sample_rate", "rate"}
CALIBRATORS = {name for name in dir(calibration) if name.startswith("calibrate")} | {"calibrate_dp_mechanism"}


def _is_one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 1


def _is_division(node: ast.AST) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)


def _called_name(call: ast.Call) -> str:
    function = call.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")


def violations(source: str, path: str) -> list[str]:
    """What ``source`` (the module at repo-relative ``path``) computes of sigma or q against the rule."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            name = _called_name(node)
            if name in CALIBRATORS and path not in SIGMA_MODULES:
                found.append(f"{where}: calls {name} (sigma is the plan's)")
            if path in Q_MODULES:
                continue
            if name == "min" and len(node.args) == 2 and any(map(_is_one, node.args)) and any(
                    map(_is_division, node.args)):
                found.append(f"{where}: min(1, a / b) (q is the plan's)")
            found += [f"{where}: sample_rate=a / b (q is the plan's)" for keyword in node.keywords
                      if keyword.arg == "sample_rate" and _is_division(keyword.value)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and path not in Q_MODULES and _is_division(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)} | {
                t.attr for t in targets if isinstance(t, ast.Attribute)}
            if names & RATE_NAMES:
                found.append(f"{where}: {sorted(names & RATE_NAMES)[0]} = a / b (q is the plan's)")
    return found


def _modules():
    for folder in ("sparta_tf", "trainers"):
        for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True):
            yield os.path.relpath(path, ROOT).replace(os.sep, "/"), path


def test_only_the_plan_computes_sigma_or_q():
    found = []
    for relative, path in _modules():
        with open(path) as f:
            found += violations(f.read(), relative)
    assert found == []
    assert os.path.exists(os.path.join(ROOT, SIGMA_MODULES[1])), "the calibration module moved: update the rule"


@pytest.mark.parametrize("source", [
    "q = min(1.0, batch / n)",
    "rate = min(batch / n, 1)",
    "self.sample_rate = b / n",
    "make(sample_rate=b / len(x))",
    "sigma = accounting.calibrate_noise_multiplier(eps, delta, q, steps)",
    "from dp_accounting import calibrate_dp_mechanism\ns = calibrate_dp_mechanism(*args)",
])
def test_the_rule_catches_a_second_computation(source):
    assert {"calibrate_noise_multiplier", "calibrate_composition"} <= CALIBRATORS
    assert violations(source, "sparta_tf/methods/example.py")
    home = SIGMA_MODULES[0] if "calibrat" in source else Q_MODULES[0]  # the plan calibrates; rates.py computes q
    assert violations(source, home) == []


def test_the_rule_lets_values_be_passed_on():
    source = "q = plan.sample_rate\nmake(sample_rate=q, noise_multiplier=plan.noise_multiplier)\nc = min(1, C)"
    assert violations(source, "sparta_tf/methods/example.py") == []


def test_the_plan_sample_rate_is_clamped_and_checks_n():
    assert sample_rate(100, 10) == 0.1 and sample_rate(5, 10) == 1.0
    with pytest.raises(ValueError, match="need at least 1"):
        sample_rate(0, 10)


# ------------------------------------------------------------------ the object a DP model runs and charges

N, BATCH = 32, 8


def _model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 3)).astype("float32"), rng.integers(0, 2, size=N)


def _compiled(dp):
    dp.compile(tf.keras.optimizers.SGD(0.1),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return dp


def test_the_step_and_the_ledger_charge_read_one_mechanism_object():
    dp = _compiled(sparta_tf.DPModel(_model(), noise_multiplier=1.3, sample_rate=BATCH / N, clip_norm=0.5,
                                     delta=1e-5, seed=0))
    x, y = _data()
    dp.fit(x, y, epochs=1, verbose=0)
    mechanism = dp.mechanism
    assert mechanism == DpSgdMechanism(1.3, BATCH / N, 0.5, N, 1e-5)
    release = dp.step_parts().release
    assert release.noise.mechanism is mechanism and release.normalise.mechanism is mechanism
    assert dp.privacy_callback.mechanism is mechanism
    steps = int(dp.dp_step.numpy())
    assert dp.ledger.entries == (mechanism.entry(steps),)
    assert dp.ledger.entries[0].as_dp_event() == mechanism.dp_event(steps)


def test_the_mechanism_of_a_model_cannot_change():
    dp = sparta_tf.DPModel(_model(), noise_multiplier=1.0, sample_rate=0.25, dataset_size=N, seed=0)
    with pytest.raises(AttributeError):
        dp.noise_multiplier = 0.1
    with pytest.raises(ValueError, match=f"dataset_size={N} but fit got 31 examples"):
        dp.bind_dataset_size(N - 1)


def test_make_private_builds_the_plan_mechanism():
    dp = sparta_tf.make_private(_model(), method="bitfit", target_epsilon=8.0, delta=1e-5, epochs=1,
                                batch_size=BATCH, dataset_size=N, clip_norm=0.7, seed=0)
    assert dp.mechanism == DpSgdMechanism.of_plan(dp.plan, clip_norm=0.7)
    assert (dp.mechanism.noise_multiplier, dp.mechanism.sample_rate) == (dp.plan.noise_multiplier, BATCH / N)


def test_the_plan_reasons_a_run_is_not_private_reach_the_ledger_once():
    method = make_method("bitfit")
    plan = plan_method(method, dataset_size=N, batch_size=BATCH, epochs=1, delta=1e-5, target_epsilon=8.0,
                       nonprivate_reasons=["the private data overlaps the public data"])
    dp = private_model(_model(), method, plan, seed=0)
    assert dp.ledger.nonprivate_reasons == plan.nonprivate_reasons == ("the private data overlaps the public data",)


def test_a_caller_privacy_callback_is_refused_even_when_it_agrees():
    dp = _compiled(sparta_tf.DPModel(_model(), noise_multiplier=1.0, sample_rate=BATCH / N, delta=1e-5, seed=0))
    x, y = _data()
    same = PrivacyCallback(dp.ledger, dp.mechanism, step_counter=dp.dp_step)
    with pytest.raises(ValueError, match="leave it out: a DPModel charges its ledger itself"):
        dp.fit(x, y, epochs=1, verbose=0, callbacks=[same])
    assert int(dp.dp_step.numpy()) == 0 and dp.ledger.steps == 0


def test_the_model_callback_cannot_be_set_to_charge_another_mechanism():
    dp = _compiled(sparta_tf.DPModel(_model(), noise_multiplier=1.0, sample_rate=BATCH / N, delta=1e-5, seed=0))
    x, y = _data()
    dp.fit(x, y, epochs=1, verbose=0)
    dp.privacy_callback.noise_multiplier = 5.0
    with pytest.raises(ValueError, match="set to charge noise_multiplier 5, .* leave it as the model built it"):
        dp.fit(x, y, epochs=1, verbose=0)
    assert dp.ledger.entries == (dp.mechanism.entry(int(dp.dp_step.numpy())),)


def test_interrupted_steps_are_charged_as_the_model_mechanism(tmp_path):
    dp = sparta_tf.DPModel(_model(), noise_multiplier=0.9, sample_rate=0.25, dataset_size=N, delta=1e-5, seed=0)
    journal = charging.StepJournal(str(tmp_path))
    journal.set_model(dp)
    for _ in range(3):
        journal.on_train_batch_begin(0)
        dp.dp_step.assign_add(1)
    lost = charging.charge_interrupted_steps(str(tmp_path), 1, dp.ledger, dp.mechanism, dp.distribute_strategy)
    assert lost == 2
    assert dp.ledger.entries == (dp.mechanism.entry(2, phase="interrupted"),)
