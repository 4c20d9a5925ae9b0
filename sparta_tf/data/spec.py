"""Validation of the ``data:`` section of a trainer config into a :class:`DataSpec`.

Every problem raises a one-line :class:`DataError` that names the offending
key (``data.<key>``) and says how to fix it. Keys a source does not use are
rejected rather than ignored, so a typo never silently changes an experiment.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from sparta_tf.data.errors import DataError, key_error

__all__ = [
    "COMMON_KEYS",
    "DataSpec",
    "NORMALIZATIONS",
    "SOURCE_KEYS",
    "may_share_examples",
    "parse_spec",
]

COMMON_KEYS: frozenset[str] = frozenset(
    {
        "source",
        "classes",
        "val_fraction",
        "test_fraction",
        "limit_train",
        "limit_test",
        "image_size",
        "channels",
        "normalize",
        "mean",
        "std",
        "split",
        "split_seed",
    }
)
"""Keys every source accepts."""

SOURCE_KEYS: dict[str, frozenset[str]] = {
    "synthetic": frozenset({"num_examples", "num_classes", "class_names"}),
    "digits": frozenset(),
    "npz": frozenset({"path", "class_names", "user_key"}),
    "idx": frozenset({"path", "class_names"}),
    "folder": frozenset({"path", "user_key"}),
    "tar": frozenset({"path", "cache_dir", "user_key"}),
    "tfds": frozenset({"name", "data_dir", "download", "user_key"}),
}
"""Keys each source accepts on top of :data:`COMMON_KEYS`."""

NORMALIZATIONS: tuple[str, ...] = ("none", "standard")
DEFAULT_SPLIT, POSITIONS_SPLIT = "hash", "positions"
SPLITS: tuple[str, ...] = (DEFAULT_SPLIT, POSITIONS_SPLIT)
"""How examples are held out: ``hash`` (each by a keyed hash of its content, stable under adding or
removing others: :mod:`sparta_tf.data.membership`) or ``positions`` (a seeded, stratified permutation of
positions, the splits of versions before stable splits: kept for results that must stay comparable)."""

DEFAULT_VAL_FRACTION = 0.1
DEFAULT_TEST_FRACTION = 0.2

ClassRef = Union[int, str]


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """A validated ``data:`` section; see :func:`sparta_tf.data.load_dataset` for the keys."""

    source: str
    path: Optional[Path] = None
    name: Optional[str] = None
    data_dir: Optional[Path] = None
    download: bool = False
    cache_dir: Optional[Path] = None
    classes: Optional[tuple[ClassRef, ...]] = None
    class_names: Optional[tuple[str, ...]] = None
    val_fraction: float = DEFAULT_VAL_FRACTION
    test_fraction: Optional[float] = None
    limit_train: Optional[int] = None
    limit_test: Optional[int] = None
    image_size: Optional[tuple[int, int]] = None
    channels: Optional[int] = None
    normalize: str = "none"
    mean: Optional[tuple[float, ...]] = None
    std: Optional[tuple[float, ...]] = None
    num_examples: int = 1000
    num_classes: int = 10
    split: str = DEFAULT_SPLIT
    split_seed: Optional[int] = None
    user_key: Optional[str] = None
    """Where each example's user id is (user-level DP, ``privacy.unit: user``): the npz arrays
    ``<user_key>_train`` / ``<user_key>_test``, a TFDS feature, or ``folder`` for image folders laid out
    ``<class>/<user>/<image>``. None: no user ids."""

    @property
    def effective_test_fraction(self) -> float:
        """The fraction carved for testing from sources without a test split."""
        return DEFAULT_TEST_FRACTION if self.test_fraction is None else self.test_fraction


def parse_spec(spec: Mapping[str, Any]) -> DataSpec:
    """Validates a ``data:`` mapping and returns the equivalent :class:`DataSpec`."""
    if not isinstance(spec, Mapping):
        raise DataError(
            f"data: expected a mapping of keys (source, path, ...), got {type(spec).__name__}; "
            "write the data section as a YAML mapping"
        )
    source = _source(spec.get("source"))
    _check_keys(spec, source)
    fields: dict[str, Any] = {"source": source}
    for key, value in spec.items():
        if key != "source":
            fields[key] = _PARSERS[key](key, value)
    _check_required(fields, source)
    _check_normalization(fields)
    _check_user_key(fields, source)
    return DataSpec(**fields)


def may_share_examples(a: DataSpec, b: DataSpec) -> bool:
    """True when ``a`` and ``b`` can read the same examples: one origin (source and file, TFDS
    name and directory, or synthetic generator) and overlapping classes (``None``: every class).
    A best-effort check on the specs alone: class references are compared as written (class 5
    given by id in one spec and by name in the other is not matched), and one file reached by two
    routes (a TFDS default directory and the same directory written out) counts as two origins."""
    if _origin(a) != _origin(b):
        return False
    return a.classes is None or b.classes is None or bool(set(a.classes) & set(b.classes))


def _origin(spec: DataSpec) -> tuple:
    path = None if spec.path is None else Path(spec.path).resolve()
    data_dir = None if spec.data_dir is None else Path(spec.data_dir).resolve()
    generator = (spec.num_examples, spec.num_classes) if spec.source == "synthetic" else None
    return spec.source, path, spec.name, data_dir, generator


def _source(value: Any) -> str:
    if value is None:
        raise key_error("source", "missing", f"set data.source to one of {sorted(SOURCE_KEYS)}")
    if value not in SOURCE_KEYS:
        raise key_error(
            "source", f"unknown source {value!r}", f"use one of {sorted(SOURCE_KEYS)}"
        )
    return value


def _check_keys(spec: Mapping[str, Any], source: str) -> None:
    allowed = COMMON_KEYS | SOURCE_KEYS[source]
    for key in spec:
        if not isinstance(key, str):
            raise DataError(f"data: key {key!r} is not a string; use key names such as 'source'")
        if key in allowed:
            continue
        if any(key in keys for keys in SOURCE_KEYS.values()):
            problem = f"not used by source {source!r}"
        else:
            problem = "unknown key"
            close = difflib.get_close_matches(key, sorted(_PARSERS), n=1)
            if close:
                problem += f" (did you mean {close[0]!r}?)"
        raise key_error(key, problem, f"remove it; source {source!r} accepts {sorted(allowed)}")


def _check_required(fields: dict[str, Any], source: str) -> None:
    if "path" in SOURCE_KEYS[source] and fields.get("path") is None:
        raise key_error("path", "missing", f"set data.path for source {source!r}")
    if source == "tfds" and fields.get("name") is None:
        raise key_error("name", "missing", "set data.name to a TFDS data set name, e.g. 'mnist'")


USER_FOLDER = "folder"


def _check_user_key(fields: dict[str, Any], source: str) -> None:
    """A user key keeps a user's examples in one split: refused with what would cut users apart."""
    if fields.get("user_key") is None:
        return
    if source in ("folder", "tar") and fields["user_key"] != USER_FOLDER:
        raise key_error("user_key", f"source {source!r} reads users from sub-folders, got {fields['user_key']!r}",
                        f"write user_key: {USER_FOLDER} with images under <class>/<user>/")
    if fields.get("split") == POSITIONS_SPLIT:
        raise key_error("split", "positions would split a user's examples across training, validation and test",
                        "remove data.split (the default holds out whole users) or data.user_key")
    for limit in ("limit_train", "limit_test"):
        if fields.get(limit) is not None:
            raise key_error(limit, "a limit on examples would cut a user's examples apart",
                            "remove the limit, or keep fewer users in the data itself")


def _check_normalization(fields: dict[str, Any]) -> None:
    has_mean, has_std = "mean" in fields, "std" in fields
    if has_mean != has_std:
        missing = "std" if has_mean else "mean"
        raise key_error(missing, "missing", "give both data.mean and data.std, or neither")
    if has_mean and fields.get("normalize", "none") != "standard":
        raise key_error(
            "normalize", "data.mean/data.std are set but normalisation is off",
            "set data.normalize: standard",
        )
    if has_mean and len(fields["mean"]) != len(fields["std"]):
        raise key_error("std", "has a different length than data.mean", "give one value per channel")


# --------------------------------------------------------------------------
# Value parsers: (key, value) -> normalised value, or raise key_error.
# --------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_int(key: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise key_error(key, f"expected a positive integer, got {value!r}", "set it to e.g. 1000")
    return int(value)


def _fraction(key: str, value: Any) -> float:
    if not _is_number(value) or not 0.0 <= value < 1.0:
        raise key_error(key, f"expected a number in [0, 1), got {value!r}", "set it to e.g. 0.1")
    return float(value)


def _test_fraction(key: str, value: Any) -> float:
    fraction = _fraction(key, value)
    if fraction == 0.0:
        raise key_error(key, "must be > 0 (the test split would be empty)", "set it to e.g. 0.2")
    return fraction


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise key_error(key, f"expected a non-empty string, got {value!r}", "quote the value")
    return value


def _path(key: str, value: Any) -> Path:
    if not isinstance(value, (str, Path)) or not str(value):
        raise key_error(key, f"expected a file system path, got {value!r}", "give a path string")
    return Path(value).expanduser()


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise key_error(key, f"expected true or false, got {value!r}", "write true or false")
    return value


def _image_size(key: str, value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(_is_int(v) and v >= 1 for v in value)
    ):
        raise key_error(key, f"expected [height, width] of positive integers, got {value!r}",
                        "write e.g. [32, 32]")
    return (int(value[0]), int(value[1]))


def _channels(key: str, value: Any) -> int:
    if not _is_int(value) or value not in (1, 3):
        raise key_error(key, f"expected 1 or 3, got {value!r}", "use 1 (grayscale) or 3 (RGB)")
    return int(value)


def _normalize(key: str, value: Any) -> str:
    if value not in NORMALIZATIONS:
        raise key_error(key, f"unknown normalisation {value!r}", f"use one of {list(NORMALIZATIONS)}")
    return value


def _classes(key: str, value: Any) -> tuple[ClassRef, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise key_error(key, f"expected a non-empty list of class ids or names, got {value!r}",
                        "write e.g. [0, 1, 2]")
    for item in value:
        if not ((_is_int(item) and item >= 0) or (isinstance(item, str) and item)):
            raise key_error(key, f"entry {item!r} is neither a class id >= 0 nor a class name",
                            "list ints or names")
    refs = tuple(int(v) if _is_int(v) else v for v in value)
    if len(set(refs)) != len(refs):
        raise key_error(key, f"has duplicate entries {list(refs)}", "list each class once")
    return refs


def _class_names(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not value or not all(
        isinstance(v, str) and v for v in value
    ):
        raise key_error(key, f"expected a non-empty list of strings, got {value!r}",
                        "write e.g. [cat, dog]")
    if len(set(value)) != len(value):
        raise key_error(key, "has duplicate names", "give each class a distinct name")
    return tuple(value)


def _floats(key: str, value: Any) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or len(value) not in (1, 3) or not all(
        _is_number(v) for v in value
    ):
        raise key_error(key, f"expected a list of 1 or 3 numbers (one per channel), got {value!r}",
                        "write e.g. [0.5, 0.5, 0.5]")
    if key == "std" and not all(v > 0 for v in value):
        raise key_error(key, f"values must be > 0, got {value!r}", "use positive standard deviations")
    return tuple(float(v) for v in value)


def _split(key: str, value: Any) -> str:
    if value not in SPLITS:
        raise key_error(key, f"unknown split {value!r}", f"use one of {list(SPLITS)} (hash: stable, the default)")
    return value


def _split_seed(key: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < 2**63:
        raise key_error(key, f"expected null or an integer in [0, 2**63), got {value!r}",
                        "leave it null for a secret split key")
    return int(value)


def _num_classes(key: str, value: Any) -> int:
    number = _positive_int(key, value)
    if number < 2:
        raise key_error(key, f"expected at least 2 classes, got {value!r}", "set it to e.g. 10")
    return number


_PARSERS = {
    "path": _path,
    "name": _text,
    "data_dir": _path,
    "download": _bool,
    "cache_dir": _path,
    "classes": _classes,
    "class_names": _class_names,
    "val_fraction": _fraction,
    "test_fraction": _test_fraction,
    "limit_train": _positive_int,
    "limit_test": _positive_int,
    "image_size": _image_size,
    "channels": _channels,
    "normalize": _normalize,
    "mean": _floats,
    "std": _floats,
    "num_examples": _positive_int,
    "num_classes": _num_classes,
    "split": _split,
    "split_seed": _split_seed,
    "user_key": _text,
}
