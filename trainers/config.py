"""The ``sparta-train`` YAML config: schema, defaults, ``--set`` overrides, validation.

Pure Python (no TensorFlow import), so a malformed config fails in well under
a second with one line that names the key and the fix::

    config error: privacy.target_epsilon=-1 must be > 0 (e.g. 1, 2, 4 or 8)

Sections (every key optional unless marked; defaults are the SPARTA paper's
vision settings where it has one):

* ``data`` (required): the private data set, see :mod:`sparta_tf.data`.
* ``pretrain``: non-private pre-training on public data before DP fine-tuning.
* ``model`` (required): ``name`` and its arguments, see :mod:`sparta_tf.models.zoo`.
* ``method``: ``name`` (one of :data:`METHOD_NAMES`, the methods of
  :mod:`sparta_tf.method_spec`) and its options, as that spec defines them
  (the table the library's methods use). Switching ``method.name`` keeps the rest of the
  config valid: an option that does not apply to the method (another
  method's option, or a value only another method accepts, e.g.
  ``score: sum_abs`` for ``dpsgd_grad``) is dropped with a one-line note
  (``config["notes"]``), not refused.
* ``privacy``: target epsilon, delta, clip norm, accountant, sampling.
* ``training``: epochs, batch sizes, optimizer, learning rates, schedule, seed, XLA,
  bit-reproducible arithmetic (``deterministic``, :mod:`sparta_tf.determinism`), weight averaging
  (``ema``, ``use_ema_weights``: :mod:`sparta_tf.optim.weight_average`).
* ``output_dir`` (required), ``export``.
* ``tuning``: ``sparta-tune``'s search (:mod:`trainers.tuning_config`); ``sparta-train`` ignores it.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Callable

import yaml

from sparta_tf import choices, method_spec, run_checks  # TensorFlow-free, as is sparta_tf.data.spec: nothing here imports TensorFlow
from sparta_tf.data.spec import DEFAULT_SPLIT, SOURCE_KEYS

METHOD_NAMES = tuple(method_spec.SPECS)


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


def _open_fraction(value):
    return None if 0 < value < 1 else "must be in (0, 1)"


def _one_of(*options):
    return lambda value: choices.one_of_problem(value, options)


SEED_LIMIT = 2**32
"""Seeds are below this: NumPy's global seed (``tf.keras.utils.set_random_seed``) is 32-bit."""


def _seed(value):
    """training.seed: a 32-bit seed (the dry run and the run both refuse a larger one)."""
    return None if 0 <= value < SEED_LIMIT else (f"must be in [0, {SEED_LIMIT - 1}] (NumPy's 32-bit seed range), "
                                                 "or null for a secret seed")


def _memory_size(value):
    """training.max_memory: bytes (a number or a string with a unit), or null for the machine's default."""
    try:
        choices.memory_bytes(value)
    except ValueError:
        return (f"must be a size in bytes >= 0, e.g. 2000000000 or '2GiB' (units {', '.join(choices.MEMORY_UNITS)}), "
                "or null for the machine's default (a quarter of the GPU's or the host's available memory)")
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
    "privacy": {
        "target_epsilon": Field(NUMBER, 8.0, _positive),
        "delta": Field(NUMBER, 1e-5, _open_fraction),
        "clip_norm": Field(NUMBER, 1.0, _positive),
        "noise_multiplier": Field(OPTIONAL_NUMBER, None, lambda v: None if v is None or v >= 0 else "must be >= 0"),
        "accountant": Field((str,), choices.ACCOUNTANTS[0], _one_of(*choices.ACCOUNTANTS)),
        "sampling": Field((str,), choices.SAMPLING_MODES[0], _one_of(*choices.SAMPLING_MODES)),
        "bands": Field((int,), 1, _at_least_one),
        "unit": Field((str,), "example", _one_of("example", "user")),
        "examples_per_user": Field(OPTIONAL_INT, None, lambda v: None if v is None or v >= 1 else "must be >= 1"),
    },
    "training": {
        "epochs": Field((int,), 50, run_checks.count_problem),
        "batch_size": Field((int,), 500, run_checks.batch_size_problem),
        "physical_batch_size": Field(OPTIONAL_INT, None, run_checks.physical_batch_size_problem),
        "optimizer": Field((str,), "sgd", _one_of("sgd", "adam")),
        "momentum": Field(NUMBER, 0.9, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
        "learning_rate": Field(NUMBER, 0.01, _positive),
        "head_learning_rate": Field(OPTIONAL_NUMBER, None, lambda v: None if v is None or v > 0 else "must be > 0"),
        "schedule": Field((str,), "cosine", _one_of("cosine", "constant")),
        "warmup_fraction": Field(NUMBER, 0.02, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
        "weight_decay": Field(NUMBER, 0.0, _non_negative),
        "seed": Field(OPTIONAL_INT, None, _seed),
        "jit_compile": Field((bool, str), "auto", run_checks.jit_compile_problem),
        "engine": Field((str,), choices.ENGINES[0], _one_of(*choices.ENGINES)),
        "max_memory": Field((int, float, str, type(None)), None, _memory_size),
        "augmult": Field((int,), 1, _at_least_one),
        "augmult_flip": Field((bool,), True),
        "augmult_pad": Field((int,), 4, _non_negative),
        "strategy": Field((str,), choices.STRATEGIES[0], _one_of(*choices.STRATEGIES)),
        "deterministic": Field((bool,), False),
        "ema": Field(OPTIONAL_NUMBER, None, lambda v: None if 0 < v < 1 else "must be a decay in (0, 1), e.g. 0.999, "
                     "or null for no weight averaging"),
        "use_ema_weights": Field((bool,), True),
    },
    "export": {
        "enabled": Field((bool,), True),
        "version": Field(OPTIONAL_INT, None, lambda v: None if v is None or v >= 1 else "must be >= 1"),
    },
}
TOP_LEVEL = ("data", "model", "pretrain", "method", "privacy", "training", "export", "output_dir", "notes", "tuning")
REQUIRED_TOP_LEVEL = ("data", "model", "output_dir")


def _or_list(names: tuple[str, ...]) -> str:
    """``"a, b or c"``."""
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _check_type(key: str, value: Any, field: Field) -> None:
    problem = method_spec.type_problem(value, field.types)
    if problem:
        raise ConfigError(f"{key}={value!r} {problem}")


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
        raise ConfigError(f"data.source is required ({_or_list(tuple(SOURCE_KEYS))})")
    config["data"].setdefault("split", DEFAULT_SPLIT)  # recorded, so that a resumed run knows its splits (trainers.split_key)
    if "name" not in config["model"]:
        raise ConfigError("model.name is required (e.g. resnet20_gn)")
    notes: list[str] = []
    for section in ("pretrain", "method", "privacy", "training", "export"):
        if section == "method":
            config["method"], notes = _validate_method(raw.get("method") or {})
        else:
            config[section] = _validate_section(section, raw.get(section) or {}, SCHEMA[section])
    config["notes"] = notes
    _check_cross_field(config)
    if raw.get("tuning") is not None:
        from trainers.tuning_config import TuningConfigError, validate_tuning

        try:
            config["tuning"] = validate_tuning(raw["tuning"], config, validate)
        except TuningConfigError as error:
            raise ConfigError(str(error)) from None
    return config


def _validate_method(given: Any) -> tuple[dict, list[str]]:
    """The ``method`` section: ``name`` and every option of that method (the given value or the default,
    :mod:`sparta_tf.method_spec`), and a note for each given option that was dropped.

    A given option is kept when it is valid for the method; dropped with a note when the method has no
    such option or the value is valid only for another method's option of that name (``score: sum_abs``
    once ``name`` is ``dpsgd_grad``), so that ``--set method.name=X`` works on any config; refused when
    the key is no method's option or the value is valid for no method.
    """
    if not isinstance(given, dict):
        raise ConfigError(f"method must be a mapping of keys, got {given!r}")
    name = given.get("name", method_spec.DEFAULT_METHOD)
    if not isinstance(name, str) or name not in method_spec.SPECS:
        raise ConfigError(f"method.name={name!r} must be one of {', '.join(METHOD_NAMES)}")
    spec = method_spec.SPECS[name]
    notes = []
    kept = {}
    for key, value in given.items():
        if key == "name":
            continue
        if key not in method_spec.ALL_OPTIONS:
            raise ConfigError(f"unknown key method.{key}; valid keys: name, {', '.join(method_spec.ALL_OPTIONS)}")
        note = _option_note(spec, key, value)
        if note:
            notes.append(note)
        else:
            kept[key] = value
    try:
        resolved = spec.resolve(kept)
    except ValueError as error:  # unreachable: every kept value was checked; one line all the same
        raise ConfigError(f"method.{error}") from None
    return {"name": name, **resolved}, notes


def _option_note(spec, key: str, value: Any) -> str | None:
    """None when ``value`` is valid for ``spec``'s option ``key``; the note saying why it is dropped when
    it is valid for another method's option ``key``; a ConfigError when it is valid for none."""
    owners = method_spec.options_named(key)
    own = next((option for owner, option in owners if owner is spec), None)
    if own is not None and own.problem(value) is None:
        return None
    if not any(option.problem(value) is None for _, option in owners):
        raise ConfigError(f"method.{key}={value!r} {(own or owners[0][1]).problem(value)}")
    if own is None:
        return f"method.{key}={value!r} does not apply to method {spec.name}; ignored"
    return (f"method.{key}={value!r} does not apply to method {spec.name} (its {key} is {own.valid}); "
            f"ignored, using {own.default!r}")


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


def _check_cross_field(config: dict) -> None:
    method, training, privacy = config["method"], config["training"], config["privacy"]
    if training["ema"] is None and training["use_ema_weights"] is False:
        raise ConfigError("training.use_ema_weights=false has no effect without training.ema: set training.ema "
                          "(e.g. 0.999) or remove use_ema_weights")
    epochs, name = training["epochs"], method["name"]
    if "warmup_epochs" in method and method["warmup_epochs"] is None:
        method["warmup_epochs"] = method_spec.default_warmup_epochs(epochs)
    private = method_spec.SPECS[name].private
    try:  # the checks make_private makes (one implementation: sparta_tf.run_checks)
        run_checks.check_run(run_checks.CONFIG, epochs=epochs, batch_size=training["batch_size"],
                             noise_multiplier=privacy["noise_multiplier"], engine=training["engine"],
                             physical_batch_size=training["physical_batch_size"], jit_compile=training["jit_compile"],
                             private=private)
        run_checks.check_method_run(run_checks.CONFIG, name, method, epochs)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if privacy["bands"] > 1 and privacy["sampling"] != "poisson":
        raise ConfigError(f"privacy.sampling: {privacy['sampling']} with privacy.bands={privacy['bands']}: correlated "
                          "noise needs cyclic Poisson sampling; set sampling: poisson, or bands: 1")
    _check_unit(config)
    pretrain = config["pretrain"]
    if pretrain["enabled"] and pretrain["data"] is None and not pretrain["checkpoint"]:
        raise ConfigError("pretrain.enabled is true but there is neither pretrain.data (the public data set to "
                          "pre-train on) nor pretrain.checkpoint (a pre-trained model); give one")


def _check_unit(config: dict) -> None:
    """``privacy.unit`` against the data's user key and what user-level DP covers (one line each)."""
    privacy, user_key = config["privacy"], config["data"].get("user_key")
    if privacy["unit"] == "example":
        if user_key is not None:
            raise ConfigError(f"data.user_key={user_key!r} is given but privacy.unit is example, so the guarantee "
                              "would protect one example, not one user: set privacy.unit: user, or remove "
                              "data.user_key")
        if privacy["examples_per_user"] is not None:
            raise ConfigError("privacy.examples_per_user needs privacy.unit: user; set it, or remove "
                              "examples_per_user")
        return
    if user_key is None:
        raise ConfigError("privacy.unit: user needs each example's user: set data.user_key (an npz array stem, a "
                          "TFDS feature, or 'folder' for <class>/<user>/<image> folders)")
    if privacy["bands"] > 1:
        raise ConfigError(f"privacy.unit: user with privacy.bands={privacy['bands']}: correlated noise's cyclic groups "
                          "are of examples, and user-level DP here covers independent noise only; set bands: 1")
    if privacy["sampling"] != "poisson":
        raise ConfigError(f"privacy.unit: user samples users with Poisson sampling; privacy.sampling="
                          f"{privacy['sampling']!r} is not that: set sampling: poisson")


def check_against_data(config: dict, n: int) -> None:
    """Checks that need the private training-set size ``n`` (:func:`sparta_tf.run_checks.check_against_data`)."""
    try:
        run_checks.check_against_data(run_checks.CONFIG, dataset_size=n, batch_size=config["training"]["batch_size"],
                                      delta=config["privacy"]["delta"])
    except ValueError as error:
        raise ConfigError(str(error)) from None
