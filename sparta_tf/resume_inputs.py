"""What a resumed run must train on as the run it continues did, recorded in every checkpoint.

A process killed after its checkpoint at step ``c`` may have run steps ``c+1 .. c+l``; the resumed run
charges them (:func:`~sparta_tf.privacy.charging.charge_interrupted_steps`) and runs steps ``c+1 ..``
again under the *same* batch and noise keys, so that it ends as an uninterrupted run would. Twice the same
release is no new release, but only on the same inputs: a step re-run on other examples (or the same in
another order, which samples others), with another clip norm, other views or user units, releases
``S' + w`` beside the killed run's ``S + w``, whose difference ``S' - S`` has no noise at all. Nor can a
resumed run change its mechanism (``sigma``, ``q``, the bands, the sampling, the banded noise's
coefficients, which follow the optimizer's momentum) under the ledger its checkpoint restores.

So every checkpoint records :func:`resume_inputs` and a resumed run whose own differs is refused in one
line, before a step (:func:`check_same_inputs`). So does the record of the mechanisms a killed run ran before
training (``before_training.json``): a run restarted before its first checkpoint runs them again, with the same
noise when the seed is fixed. The examples are a digest of the arrays (with the user
ids), a secret of the run kept with its checkpoints (:func:`~sparta_tf.privacy.array_inputs.examples_fingerprint`);
a ``tf.data.Dataset`` input cannot be digested and is recorded as None. A checkpoint that does not record
them (written before they were recorded) is not checked.
"""

from __future__ import annotations

import json
import math
from typing import Any

import tensorflow as tf

from sparta_tf.checkpointing import CheckpointError
from sparta_tf.privacy.array_inputs import examples_fingerprint

STATE_KEY = "inputs"
"""The key of :func:`resume_inputs` in a checkpoint's ``state.json``."""

_WHAT = {
    "examples": ("other training examples (or the same in another order, or preprocessed otherwise: another "
                 "TensorFlow version or device)", "the same arrays in the same order"),
    "method": ("other method options", "the same method and options"),
    "noise_multiplier": ("another noise multiplier", "the same privacy settings (target epsilon, delta, batch "
                                                     "size, epochs)"),
    "sample_rate": ("another sample rate", "the same batch size and data"),
    "bands": ("another number of bands", "the same bands"),
    "clip_norm": ("another clip norm", "the same clip norm"),
    "sampling": ("another sampling", "the same sampling"),
    "noise_coefficients": ("other banded noise coefficients (another momentum)", "the same optimizer momentum"),
    "views": ("another augmentation multiplicity", "the same augmult"),
    "examples_per_user": ("another examples_per_user", "the same examples_per_user"),
}


def resume_inputs(dp, plan, x: Any, y: Any, users: Any = None, method=None) -> dict[str, Any]:
    """The inputs of ``dp``'s run (``plan``'s mechanism, ``fit``'s arrays, ``method``'s name and options,
    which steer the mechanisms before training) that a resumed run must share (module doc), as JSON values."""
    noise = getattr(dp, "correlated_noise", None)
    return {
        "method": None if method is None else _json_value([method.name, _options(method)]),
        "examples": None if x is None or isinstance(x, tf.data.Dataset) else examples_fingerprint(x, (y, users)),
        "noise_multiplier": None if plan.noise_multiplier is None else float(plan.noise_multiplier),
        "sample_rate": float(plan.sample_rate),
        "bands": int(plan.bands),
        "clip_norm": float(dp.clip_norm),
        "sampling": dp.sampling,
        "noise_coefficients": None if noise is None else [float(c) for c in noise.coefficients],
        "views": int(dp.augmult),
        "examples_per_user": None if dp.users is None else int(dp.users.examples_per_user),
    }


def check_same_inputs(source: str, recorded: dict[str, Any] | None, inputs: dict[str, Any]) -> None:
    """CheckpointError (one line) unless ``inputs`` are the ``recorded`` ones (None: nothing recorded, not
    checked) of ``source`` (e.g. ``"checkpoint <path>"``)."""
    if recorded is None:
        return
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{source} is damaged (its inputs are not an object): what the killed run trained on "
                              "cannot be checked, so it cannot be resumed safely; start a new output_dir")
    for key, (other, fix) in _WHAT.items():
        if key in recorded and not _same(recorded[key], inputs.get(key)):
            raise CheckpointError(
                f"{source} was written by a run with {other} than this one: a resumed run runs what the killed run "
                f"released last again with the same noise, which releases nothing new only on the same inputs; "
                f"resume with {fix}, or start a new output_dir")


def _options(method) -> dict[str, Any]:
    """``method``'s options but a loaded mask's path: the mask itself is checked by its digest
    (:func:`~sparta_tf.private_training.check_same_mask`), so a mask file moved elsewhere resumes."""
    return {name: value for name, value in getattr(method, "option_values", {}).items() if name != "mask"}


def _json_value(value: Any) -> Any:
    """``value`` as it reads back from JSON (a value JSON cannot hold by its type's name: its ``repr`` may name
    a memory address), so that a run's own record compares equal to the one its checkpoint holds."""
    return json.loads(json.dumps(value, sort_keys=True, default=lambda other: type(other).__name__))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b
