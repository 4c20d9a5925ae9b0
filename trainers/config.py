"""The ``sparta-train`` YAML config: schema, defaults, ``--set`` overrides, validation.

Pure Python (no TensorFlow import), so a malformed config fails in well under
a second with one line that names the key and the fix::

    config error: privacy.target_epsilon=-1 must be > 0 (e.g. 1, 2, 4 or 8)

Sections (every key optional unless marked; defaults are the SPARTA paper's
vision settings where it has one):

* ``data`` (required): the private data set, see :mod:`sparta_tf.data`.
* ``pretrain``: non-private pre-training on public data before DP fine-tuning.
* ``model`` (required): ``name`` and its arguments, see :mod:`sparta_tf.models.zoo`.
* ``method``: ``name`` (one of :data:`METHOD_OPTIONS`: sparta, all, last,
  bitfit, x_bitfit, mp, random, dpsgd_grad, oracle, dp_frost, dp_ssgd) and
  its options. Switching ``method.name`` keeps the rest of the config valid:
  an option given for another method is dropped with a one-line note
  (``config["notes"]``), not refused.
* ``privacy``: target epsilon, delta, clip norm, accountant, sampling.
* ``training``: epochs, batch sizes, optimizer, learning rates, schedule, seed, XLA,
  bit-reproducible arithmetic (``deterministic``, :mod:`sparta_tf.determinism`).
* ``output_dir`` (required), ``export``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import Any, Callable

import yaml

_SELECTION = ("warmup_epochs", "score", "mask", "density", "granularity", "density_overrides")
_MASK = ("density", "granularity", "density_overrides")
METHOD_OPTIONS: dict[str, tuple[str, ...]] = {
    "sparta": _SELECTION, "dpsgd_grad": _SELECTION, "oracle": _SELECTION,
    "all": (), "last": (), "bitfit": (),
    "x_bitfit": ("full_epochs", "bitfit_learning_rate_scale"),
    "mp": _MASK, "random": _MASK + ("seed",),
    "dp_frost": ("frost_magnitude", "frost_alpha", "r_eps", "frost_iterations", "q_ps", "nu", "gamma"),
    "dp_ssgd": ("prune", "prune_rate", "drop_rate", "drop_mode", "snip_noise_multiplier", "synflow_iterations"),
}
"""The options of each method (``sparta_tf.methods.METHODS[name].options``, kept here so that
the config is checked without importing TensorFlow; a test keeps the two equal)."""
METHOD_NAMES = tuple(METHOD_OPTIONS)
SCORES = {"sparta": ("sum_abs", "abs_sum"), "dpsgd_grad": ("signed",), "oracle": ("oracle",)}


class ConfigError(ValueError):
    """A config problem, reported as one line naming the key and the fix."""


@dataclasses.dataclass(frozen=True)
class Field:
    """One config key: its type(s), default and an optional value check returning an error or None."""

    types: tuple
    default: Any = None
    check: Callable[[Any], str | None] | None = None
    required: bool = False
    free_form: bool = False  # a dict whose keys are validated elsewhere (data / model arguments)


def _positive(value):
    return None if value > 0 else "must be > 0"


def _non_negative(value):
    return None if value >= 0 else "must be >= 0"


def _at_least_one(value):
    return None if value >= 1 else "must be >= 1"


def _fraction(value):
    return None if 0 <= value <= 1 else "must be in [0, 1]"


def _open_fraction(value):
    return None if 0 < value < 1 else "must be in (0, 1)"


def _one_of(*choices):
    def check(value):
        return None if value in choices else f"must be one of {', '.join(map(str, choices))}"
    return check


SEED_LIMIT = 2**32
"""Seeds are below this: NumPy's global seed (``tf.keras.utils.set_random_seed``) is 32-bit."""


def _seed(value):
    """training.seed: a 32-bit seed (the dry run and the run both refuse a larger one)."""
    return None if 0 <= value < SEED_LIMIT else (f"must be in [0, {SEED_LIMIT - 1}] (NumPy's 32-bit seed range), "
                                                 "or null for a secret seed")


def _density_overrides(value):
    for pattern, density in value.items():
        if not isinstance(density, (int, float)) or isinstance(density, bool) or not 0 <= density <= 1:
            return f"has {pattern!r}: {density!r}; every density must be a number in [0, 1]"
    return None


NUMBER = (int, float)
OPTIONAL_NUMBER = (int, float, type(None))
OPTIONAL_INT = (int, type(None))
OPTIONAL_STR = (str, type(None))

SCHEMA: dict[str, dict[str, Field]] = {
    "data": {},  # free-form, validated by sparta_tf.data (source required)
    "model": {},  # free-form, validated by sparta_tf.models.zoo (name required)
    "pretrain": {
        "enabled": Field((bool,), False),
        "data": Field((dict, type(None)), None, free_form=True),
        "epochs": Field((int,), 15, _at_least_one),
        "batch_size": Field((int,), 128, _at_least_one),
        "learning_rate": Field(NUMBER, 3e-3, _positive),
        "optimizer": Field((str,), "adam", _one_of("adam", "sgd")),
        "augment": Field((bool,), True),
        "checkpoint": Field(OPTIONAL_STR, None),
    },
    "method": {
        "name": Field((str,), "sparta", _one_of(*METHOD_NAMES)),
        "density": Field(NUMBER, 0.2, _fraction),
        "warmup_epochs": Field(OPTIONAL_INT, None, lambda v: None if v is None or v >= 0 else "must be >= 0"),
        "score": Field(OPTIONAL_STR, None),
        "granularity": Field(OPTIONAL_STR, None, lambda v: None if v in (None, "row", "entry") else "must be row or entry"),
        "density_overrides": Field((dict,), {}, _density_overrides),
        "mask": Field(OPTIONAL_STR, None),
        "seed": Field((int,), 0, lambda v: None if 0 <= v < 2**63 else "must be in [0, 2**63)"),
        "full_epochs": Field((int,), 1, _non_negative),
        "bitfit_learning_rate_scale": Field(NUMBER, 5.0, _positive),
        # DP-FROST (paper defaults): magnitude, alpha, budget ratio, PSEL rounds, rate, gap, unfreezing ratio
        "frost_magnitude": Field((str,), "mgna", _one_of("mg", "mgn", "mgna")),
        "frost_alpha": Field((int,), 1, _one_of(1, 2)),
        "r_eps": Field(NUMBER, 0.9, _open_fraction),
        "frost_iterations": Field((int,), 5, _at_least_one),
        "q_ps": Field(NUMBER, 0.02, _open_fraction),
        "nu": Field(NUMBER, 5.0, _positive),
        "gamma": Field(NUMBER, 0.2, lambda v: None if 0 < v <= 1 else "must be in (0, 1]"),
        # DP-SSGD: pre-pruning and gradient dropping
        "prune": Field((str,), "random", _one_of("none", "random", "synflow", "dp_snip")),
        "prune_rate": Field(NUMBER, 0.5, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
        "drop_rate": Field(NUMBER, 0.5, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
        "drop_mode": Field((str,), "random", _one_of("random", "magnitude")),
        "snip_noise_multiplier": Field(NUMBER, 5.0, _positive),
        "synflow_iterations": Field((int,), 100, _at_least_one),
    },
    "privacy": {
        "target_epsilon": Field(NUMBER, 8.0, _positive),
        "delta": Field(NUMBER, 1e-5, _open_fraction),
        "clip_norm": Field(NUMBER, 1.0, _positive),
        "noise_multiplier": Field(OPTIONAL_NUMBER, None, lambda v: None if v is None or v >= 0 else "must be >= 0"),
        "accountant": Field((str,), "pld", _one_of("pld", "rdp")),
        "sampling": Field((str,), "poisson", _one_of("poisson", "shuffle")),
    },
    "training": {
        "epochs": Field((int,), 50, _at_least_one),
        "batch_size": Field((int,), 500, _at_least_one),
        "physical_batch_size": Field(OPTIONAL_INT, None, lambda v: None if v is None or v >= 1 else "must be >= 1"),
        "optimizer": Field((str,), "sgd", _one_of("sgd", "adam")),
        "momentum": Field(NUMBER, 0.9, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
        "learning_rate": Field(NUMBER, 0.01, _positive),
        "head_learning_rate": Field(OPTIONAL_NUMBER, None, lambda v: None if v is None or v > 0 else "must be > 0"),
        "schedule": Field((str,), "cosine", _one_of("cosine", "constant")),
        "warmup_fraction": Field(NUMBER, 0.02, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
        "weight_decay": Field(NUMBER, 0.0, _non_negative),
        "seed": Field(OPTIONAL_INT, None, _seed),
        "jit_compile": Field((bool, str), "auto", lambda v: None if v in (True, False, "auto") else "must be true, false or auto"),
        "engine": Field((str,), "auto", _one_of("auto", "bookkeeping", "layerwise", "vectorized")),
        "strategy": Field((str,), "default", _one_of("default", "mirrored", "multi_worker")),
        "deterministic": Field((bool,), False),
    },
    "export": {
        "enabled": Field((bool,), True),
        "version": Field(OPTIONAL_INT, None, lambda v: None if v is None or v >= 1 else "must be >= 1"),
    },
}
TOP_LEVEL = ("data", "model", "pretrain", "method", "privacy", "training", "export", "output_dir", "notes")
REQUIRED_TOP_LEVEL = ("data", "model", "output_dir")


def _type_name(types: tuple) -> str:
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string", dict: "a mapping",
             type(None): "null"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def _check_type(key: str, value: Any, field: Field) -> None:
    ok = isinstance(value, field.types) and not (isinstance(value, bool) and bool not in field.types)
    if not ok:
        raise ConfigError(f"{key}={value!r} must be {_type_name(field.types)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a finite number")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                                  f"{key_node.start_mark.line + 1}); keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads a float only with a dot: ``1e-5`` and ``1e-05`` (as json.dump writes them in a
# run's config.json) would be strings. YAML 1.2 and JSON read them as floats, and so does this loader.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_value(text: str) -> Any:
    """A ``--set`` value parsed as YAML (``1e-5`` -> float, ``true`` -> bool, ``[a, b]`` -> list)."""
    try:
        value = _yaml(text)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or type(error).__name__
        raise ConfigError(f"value {text!r} is not valid YAML ({problem}); quote text values, e.g. "
                          "output_dir='runs/a b'") from None
    if isinstance(value, str) and _looks_like_float(value):  # Python's spellings the loader leaves as text:
        return float(value)  # inf, nan, Infinity (so a --set inf is refused as "not finite", not "not a number")
    return value


def _looks_like_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    """``section.key=value`` assignments (YAML values) applied to a copy of ``config``."""
    config = copy.deepcopy(config)
    for item in overrides:
        path, sep, text = item.partition("=")
        if not sep or not path:
            raise ConfigError(f"--set {item!r} must look like section.key=value (e.g. privacy.target_epsilon=2)")
        node = config
        parts = path.split(".")
        if not all(parts):
            raise ConfigError(f"--set {item!r}: {path!r} has an empty key; write section.key=value")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part} is not a section")
        try:
            node[parts[-1]] = parse_value(text)
        except ConfigError as error:
            raise ConfigError(f"--set {item!r}: {error}") from None
    return config


def load_config(path: str, overrides: list[str] | None = None) -> dict:
    """Reads, overrides and validates a config; returns it with every default filled in."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        raw = _yaml(text)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass --config configs/NAME.yaml") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; pass the YAML file, e.g. "
                          "--config configs/quickstart.yaml") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable (permission denied); fix its permissions") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
                          f"offset {error.start}); save it as UTF-8 YAML") from None
    except ConfigError as error:
        raise ConfigError(f"config file {path}: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: fix the syntax") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must be a mapping of sections (data, model, method, ...)")
    return validate(apply_overrides(raw, overrides or []))


def validate(raw: dict) -> dict:
    """Checks keys, types and ranges that need no data; returns a config with defaults filled in."""
    for key in raw:
        if key not in TOP_LEVEL:
            raise ConfigError(f"unknown section {key!r}; valid sections: {', '.join(TOP_LEVEL)}")
    for key in REQUIRED_TOP_LEVEL:
        if raw.get(key) in (None, {}):
            raise ConfigError(f"missing required {key!r}; see configs/quickstart.yaml for an example")
    if not isinstance(raw["output_dir"], str):
        raise ConfigError(f"output_dir={raw['output_dir']!r} must be a string path")
    config: dict[str, Any] = {"output_dir": raw["output_dir"]}
    for section in ("data", "model"):
        value = raw[section]
        if not isinstance(value, dict):
            raise ConfigError(f"{section} must be a mapping (e.g. {section}: {{...}})")
        config[section] = dict(value)
    if "source" not in config["data"]:
        raise ConfigError("data.source is required (synthetic, digits, npz, idx, folder, tar or tfds)")
    if "name" not in config["model"]:
        raise ConfigError("model.name is required (e.g. resnet20_gn)")
    for section, fields in SCHEMA.items():
        if section in ("data", "model"):
            continue
        config[section] = _validate_section(section, raw.get(section) or {}, fields)
    config["notes"] = _keep_method_options(config["method"], raw.get("method") or {})
    _check_cross_field(config)
    return config


def _keep_method_options(method: dict, given: dict) -> list[str]:
    """Drops the options that do not apply to ``method.name``; a note for each one the user gave."""
    applicable = METHOD_OPTIONS[method["name"]]
    notes = [f"method.{key}={given[key]!r} does not apply to method {method['name']}; ignored"
             for key in given if key != "name" and key not in applicable]
    for key in list(method):
        if key != "name" and key not in applicable:
            del method[key]
    return notes


def _validate_section(section: str, values: Any, fields: dict[str, Field]) -> dict:
    if not isinstance(values, dict):
        raise ConfigError(f"{section} must be a mapping of keys, got {values!r}")
    for key in values:
        if key not in fields:
            raise ConfigError(f"unknown key {section}.{key}; valid keys: {', '.join(fields)}")
    result = {}
    for key, field in fields.items():
        value = values.get(key, copy.deepcopy(field.default))
        name = f"{section}.{key}"
        if key in values:
            _check_type(name, value, field)
        if key in values and field.check is not None and value is not None:
            problem = field.check(value)
            if problem:
                raise ConfigError(f"{name}={value!r} {problem}")
        result[key] = value
    return result


def default_warmup_epochs(epochs: int) -> int:
    """``T0 = T / 5``, at least 1: ``sparta_tf.methods.selection_epoch.default_warmup_epochs``, kept
    here so that the config is checked without importing TensorFlow (a test keeps the two equal)."""
    return max(1, epochs // 5)


def _check_cross_field(config: dict) -> None:
    method, training, privacy = config["method"], config["training"], config["privacy"]
    epochs, name = training["epochs"], method["name"]
    if "warmup_epochs" in method:
        if method["warmup_epochs"] is None:
            method["warmup_epochs"] = default_warmup_epochs(epochs)
        warmup = method["warmup_epochs"]
        selection = 1 if method["mask"] is None else 0
        if warmup + selection >= epochs:
            raise ConfigError(f"method.warmup_epochs={warmup} must be < training.epochs - {selection} "
                              f"(={epochs - selection}): the warm-up{' + 1 selection epoch' if selection else ''} "
                              "must leave a sparse epoch")
    if "score" in method and method["score"] is not None and method["score"] not in SCORES[name]:
        raise ConfigError(f"method.score={method['score']!r} is not a score of {name}; use "
                          f"{' or '.join(SCORES[name])} (or another method.name)")
    if name == "x_bitfit" and method["full_epochs"] >= epochs:
        raise ConfigError(f"method.full_epochs={method['full_epochs']} must be < training.epochs (={epochs}) "
                          "so that the bias-only phase runs")
    if "density" in method and method["density"] == 0 and method.get("mask") is None \
            and not any(value > 0 for value in method["density_overrides"].values()):
        spends = " after its selection epoch has spent epsilon" if "warmup_epochs" in method else ""
        raise ConfigError(f"method.density=0 keeps no kernel row or entry: method {name} would train only the "
                          f"biases, norms and head{spends}; use method.name=bitfit for that, or a density in (0, 1]")
    if method.get("score") == "signed" and method.get("granularity") == "row":
        raise ConfigError("method.granularity=row cannot be used with score signed; use entry")
    pretrain = config["pretrain"]
    if pretrain["enabled"] and pretrain["data"] is None and not pretrain["checkpoint"]:
        raise ConfigError("pretrain.enabled is true but there is neither pretrain.data (the public data set to "
                          "pre-train on) nor pretrain.checkpoint (a pre-trained model); give one")
    physical = training["physical_batch_size"]
    if physical is not None and physical < 1:
        raise ConfigError(f"training.physical_batch_size={physical} must be >= 1")
    if privacy["noise_multiplier"] is not None and privacy["noise_multiplier"] == 0 and name != "oracle":
        raise ConfigError("privacy.noise_multiplier=0 gives no privacy; leave it null to calibrate it "
                          "from privacy.target_epsilon")


def check_against_data(config: dict, n: int) -> None:
    """Checks that need the private training-set size ``n``."""
    delta, batch = config["privacy"]["delta"], config["training"]["batch_size"]
    if delta >= 1.0 / n:
        raise ConfigError(f"privacy.delta={delta:g} must be < 1/n = {1.0 / n:.3g} for n={n} training examples "
                          f"(e.g. delta: {10 ** -len(str(n)):g})")
    if batch > n:
        raise ConfigError(f"training.batch_size={batch} is larger than the training set (n={n}); use <= {n}")
