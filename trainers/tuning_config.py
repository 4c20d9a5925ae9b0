"""The ``tuning`` section of a ``sparta-tune`` config: validated without TensorFlow, one line per problem.

::

    tuning:
      space:                                  # dotted config keys -> a list, or {log_uniform: [low, high]}
        training.learning_rate: [0.03, 0.1, 0.3]
        method.density: [0.05, 0.2]
      # or a list of points, for values that move together:
      # space: [{training.learning_rate: 0.03, training.head_learning_rate: 0.3}, ...]
      mean: 5                                 # mean number of candidate runs
      shape: geometric                        # logarithmic (0), geometric (1), poisson, or a number >= 0
      score_noise: null                       # std (examples) of the noisy validation count; null: sqrt(n_val)/2
      seed: null                              # the tuning's secret seed; set it only for tests

Every candidate is a ``sparta-train`` run of the config with its drawn values set; the run's privacy
section is the tuning's total budget.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any

from sparta_tf.choices import candidate_mean, candidate_shape
from sparta_tf.tuning.space import check_space, corners, names

TUNABLE_SECTIONS = ("training", "method", "privacy")

FIXED_KEYS = {
    "training.epochs": "the number of steps",
    "training.batch_size": "the sample rate and the number of steps",
    "training.seed": "the data split (every candidate must see one split)",
    "training.strategy": "where the run executes",
    "training.deterministic": "process-wide settings",
    "privacy.target_epsilon": "the budget (the tuning's total)",
    "privacy.delta": "the budget",
    "privacy.noise_multiplier": "the noise (calibrated by the tuning)",
    "privacy.accountant": "the accounting (the tuning's is RDP)",
    "privacy.sampling": "the mechanism",
    "privacy.bands": "the mechanism (the correlated noise and cyclic sampling)",
    "method.name": "the mechanism (tune one method per tuning)",
    "method.mask": "the mechanism",
}
"""Keys a candidate may not change, and what they would change: every candidate must run the same privacy
mechanism (the analysis repeats one), and see the same data."""

DEFAULTS = {"space": None, "mean": 5.0, "shape": "geometric", "score": "accuracy", "score_noise": None,
            "seed": None}


class TuningConfigError(ValueError):
    """A tuning section problem (the CLI reports it as a config error)."""


def validate_tuning(raw: Any, config: dict, validate) -> dict:
    """The ``tuning`` section with defaults filled in; ``config``: the validated rest of the config;
    ``validate``: the config validator (each list value and range end is checked as a config value)."""
    if not isinstance(raw, dict):
        raise TuningConfigError(f"tuning must be a mapping (space, mean, shape, ...), got {raw!r}")
    unknown = [key for key in raw if key not in DEFAULTS]
    if unknown:
        raise TuningConfigError(f"unknown key tuning.{unknown[0]}; valid keys: {', '.join(DEFAULTS)}")
    tuning = {**copy.deepcopy(DEFAULTS), **raw}
    if tuning["space"] is None:
        raise TuningConfigError("tuning.space is required, e.g. {training.learning_rate: [0.03, 0.1, 0.3]}")
    try:
        tuning["space"] = check_space(tuning["space"], "tuning.space")
        candidate_mean(tuning["mean"], candidate_shape(tuning["shape"]))
    except ValueError as error:
        raise TuningConfigError(str(error) if str(error).startswith("tuning.") else f"tuning.{error}") from None
    if tuning["score"] != "accuracy":
        raise TuningConfigError(f"tuning.score={tuning['score']!r} must be accuracy (the noisy count of correct "
                                "validation predictions)")
    noise = tuning["score_noise"]
    if noise is not None and (isinstance(noise, bool) or not isinstance(noise, numbers.Real) or not noise > 0
                              or not math.isfinite(noise)):
        raise TuningConfigError(f"tuning.score_noise={noise!r} must be > 0 (examples), or null for sqrt(n_val)/2")
    seed = tuning["seed"]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise TuningConfigError(f"tuning.seed={seed!r} must be an integer in [0, 2**63), or null for a secret seed")
    for key in names(tuning["space"]):
        _check_key(key, config)
    for point in corners(tuning["space"]):
        try:
            validate(candidate_config(config, point))
        except ValueError as error:
            raise TuningConfigError(f"tuning.space: a candidate with {point} is not a valid config: {error}") from None
    if config["privacy"]["noise_multiplier"] is not None:
        raise TuningConfigError("privacy.noise_multiplier is set: a tuning calibrates each candidate's noise from "
                                "privacy.target_epsilon (the whole tuning's budget); leave it null")
    return tuning


def _check_key(key: str, config: dict) -> None:
    section, _, name = key.partition(".")
    if section not in TUNABLE_SECTIONS or not name or "." in name:
        raise TuningConfigError(f"tuning.space.{key}: name a key as section.key with section one of "
                                f"{', '.join(TUNABLE_SECTIONS)} (e.g. training.learning_rate)")
    if key in FIXED_KEYS:
        raise TuningConfigError(f"tuning.space.{key} changes {FIXED_KEYS[key]}; every candidate must run the same "
                                "privacy mechanism: set it outside the space")
    if name not in config[section]:
        raise TuningConfigError(f"tuning.space.{key}: {section} has no key {name!r} (for method "
                                f"{config['method']['name']}); valid keys: {', '.join(sorted(config[section]))}")


def candidate_config(config: dict, values: dict) -> dict:
    """``config`` (without its tuning section) with each dotted key of ``values`` set."""
    candidate = copy.deepcopy({k: v for k, v in config.items() if k not in ("tuning", "notes")})
    for key, value in values.items():
        section, _, name = key.partition(".")
        candidate[section][name] = value
    return candidate
