"""``load_dataset``: spec -> source -> classes -> splits -> limits -> pixels -> Dataset.

Order of operations (every held-out split is decided per example by a keyed hash of its
content, :mod:`sparta_tf.data.membership`, so one example more or less changes no other
example's split; ``split: positions`` instead takes seeded, stratified positions,
:mod:`sparta_tf.data.splits`, as versions before stable splits did):

1. the source lists its train (and test, if any) split;
2. ``classes`` keeps the listed classes and relabels them ``0 .. k-1``;
3. a source without a test split gives ``test_fraction`` of its train data
   to the test split (before any limit, so limits never move test examples);
4. ``limit_train`` / ``limit_test`` keep deterministic subsets;
5. ``val_fraction`` of the (limited) train data becomes the validation split;
6. only then are the selected images read, scaled to [0, 1], converted to
   ``channels``, resized to ``image_size`` and, with ``normalize: standard``,
   standardised with per-channel statistics of the final train split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from sparta_tf import random_streams
from sparta_tf.data.dataset import Dataset
from sparta_tf.data.errors import DataError, key_error
from sparta_tf.data.images import convert_channels, resize_images, to_unit_float
from sparta_tf.data import membership
from sparta_tf.data.normalize import channel_stats, fixed_stats, standardize
from sparta_tf.data.raw import RawData, Split
from sparta_tf.data.sources import SOURCES
from sparta_tf.data.spec import POSITIONS_SPLIT, ClassRef, DataSpec, parse_spec
from sparta_tf.data.splits import fraction_count, stratified_take

__all__ = ["build_dataset", "derived_split_key", "load_dataset"]

MAX_LISTED_NAMES = 12


@dataclasses.dataclass(frozen=True)
class _Part:
    """Selected examples of one source split: positions ``index``, new labels ``y`` and, once a stable
    split needed them, the examples' content ``digests`` (:func:`membership.content_digests`)."""

    split: Split
    index: np.ndarray
    y: np.ndarray
    digests: Optional[list] = None

    def subset(self, positions: np.ndarray) -> "_Part":
        digests = None if self.digests is None else [self.digests[p] for p in positions]
        return _Part(self.split, self.index[positions], self.y[positions], digests)

    def with_digests(self) -> "_Part":
        if self.digests is not None:
            return self
        if self.split.users is not None:  # a user is held out whole (membership.user_digests)
            return dataclasses.replace(self, digests=membership.user_digests(self.split.users[self.index]))
        return dataclasses.replace(self, digests=membership.content_digests(self.split, self.index))

    @property
    def users(self) -> Optional[np.ndarray]:
        """The selected examples' user ids (None: the source has none)."""
        return None if self.split.users is None else self.split.users[self.index]


@dataclasses.dataclass(frozen=True)
class _Splitter:
    """How examples are held out: by a keyed hash of each example (``key``; stable) or, with ``key=None``
    (``data.split: positions``), by a seeded stratified permutation of positions (``seed``)."""

    seed: int
    key: Optional[int]

    def carve(self, part: _Part, fraction: float, purpose: str) -> tuple[_Part, _Part]:
        """``(held out, rest)`` of ``part`` for ``purpose`` (a registered stream's name) at ``fraction``."""
        random_streams.stream(purpose)  # a registered name: the positions split draws from that stream
        if self.key is None:
            taken, rest = stratified_take(part.y, fraction_count(len(part.y), fraction),
                                          random_streams.numpy_rng(self.seed, purpose))
            return part.subset(taken), part.subset(rest)
        part = part.with_digests()
        taken, rest = membership.held_out(membership.uniform_scores(part.digests, self.key, purpose), fraction)
        return part.subset(taken), part.subset(rest)

    def limit(self, part: _Part, limit: Optional[int], purpose: str) -> _Part:
        """At most ``limit`` examples of ``part`` (``purpose``: a registered stream's name)."""
        random_streams.stream(purpose)
        if limit is None or limit >= len(part.y):
            return part
        if self.key is None:
            taken, _ = stratified_take(part.y, limit, random_streams.numpy_rng(self.seed, purpose))
            return part.subset(taken)
        part = part.with_digests()
        return part.subset(membership.smallest(membership.uniform_scores(part.digests, self.key, purpose), limit))


def load_dataset(spec: Mapping[str, Any], *, seed: int = 0, split_key: Optional[int] = None) -> Dataset:
    """Loads the data set described by a config's ``data:`` section.

    Keys (all sources): ``source`` (synthetic | digits | npz | idx | folder |
    tar | tfds), ``classes``, ``val_fraction`` (0.1), ``test_fraction`` (0.2,
    sources without a test split only), ``limit_train``, ``limit_test``,
    ``image_size`` ([H, W]), ``channels`` (1 | 3), ``normalize`` (none |
    standard), ``mean`` / ``std`` (fixed statistics for ``standard``).
    Per source: ``path`` (npz, idx, folder, tar), ``cache_dir`` (tar),
    ``name`` / ``data_dir`` / ``download`` (tfds), ``num_examples`` /
    ``num_classes`` (synthetic), ``class_names`` (synthetic, npz, idx).
    ``split`` (hash | positions) and ``split_seed`` choose how examples are held out (below).
    ``seed`` fixes every random choice (synthetic data, ``split: positions``).

    The split key of the stable (``hash``) splits: ``data.split_seed`` when given, else ``split_key``
    (``sparta-train`` passes a secret one of its own), else one derived from ``seed``; a key that
    is not secret (the first and the last) is recorded in :meth:`Dataset.privacy_caveats`.
    Raises :class:`DataError` (one line, naming the key) on any problem.
    """
    parsed = parse_spec(spec)
    seed = _check_seed(seed)
    return build_dataset(SOURCES[parsed.source](parsed, seed), parsed, seed, split_key)


def build_dataset(raw: RawData, spec: DataSpec, seed: int, split_key: Optional[int] = None) -> Dataset:
    """Applies steps 2-6 of the module docstring to a source's :class:`RawData` (``split_key``: as for
    :func:`load_dataset`)."""
    splitter, caveats = _splitter(spec, seed, split_key)
    kept = _resolve_classes(spec.classes, raw.class_names)
    train = _select(raw.train, kept)
    if len(train.index) == 0:
        raise key_error("classes", f"no training examples in the selected classes of {raw.name!r}",
                        "check data.classes and the data files")
    _check_class_counts(train.y, kept, raw.class_names)
    train, test = _test_split(raw, train, kept, spec, splitter)
    train = splitter.limit(train, spec.limit_train, "limit_train")
    # a caveat whenever a limit is set: at exactly the limit nothing is cut, yet one example more displaces one
    limited = splitter.key is not None and spec.limit_train is not None
    test = splitter.limit(test, spec.limit_test, "limit_test")
    val, train = splitter.carve(train, spec.val_fraction, "val_split")
    if len(train.y) == 0:
        raise key_error("val_fraction", f"leaves no training examples out of {len(train.y) + len(val.y)}",
                        "lower data.val_fraction or raise data.limit_train")
    parts = {"train": train, "val": val, "test": test}
    digests: dict = {}
    arrays = _pixels(parts, spec, raw.name, digests)
    mean, std = _statistics(arrays["train"], spec)
    return Dataset(
        x_train=standardize(arrays["train"], mean, std),
        y_train=parts["train"].y,
        x_val=standardize(arrays["val"], mean, std),
        y_val=parts["val"].y,
        x_test=standardize(arrays["test"], mean, std),
        y_test=parts["test"].y,
        users_train=parts["train"].users,
        users_val=parts["val"].users,
        users_test=parts["test"].users,
        num_classes=len(kept),
        class_names=[raw.class_names[k] for k in kept],
        name=raw.name,
        mean=mean,
        std=std,
        statistics_from_private_data=spec.normalize == "standard" and spec.mean is None,
        class_count_from_private_labels=raw.class_names_from_labels and spec.classes is None,
        channels_from_private_data=raw.channels_from_data and spec.channels is None,
        stored_image_digests=digests,
        split_caveats=tuple(caveats + ([LIMIT_CAVEAT.format(limit=spec.limit_train)] if limited else [])
                            + ([CLASS_RANKS_CAVEAT] if raw.class_ids_are_folder_ranks and spec.classes is not None
                               and any(isinstance(c, int) for c in spec.classes) else [])),
    )


CLASS_RANKS_CAVEAT = ("data.classes names classes by number, which for image folders is a folder's rank among the "
                      "private class folders, so one image in a new folder can change which classes are used; name "
                      "the classes instead (their folder names)")

POSITIONS_CAVEAT = ("data.split: positions holds out a seeded permutation of positions, so one example more or "
                    "less moves others between the training and validation splits: the guarantee covers the "
                    "splits as given, not the data set before splitting; remove data.split for stable splits")
KNOWN_KEY_CAVEAT = ("the data split's key is known ({where}): whoever has it and the data can tell which examples "
                    "were held out for validation and testing; keep it as secret as the data, or leave data.split_seed "
                    "and training.seed null for a secret key")
LIMIT_CAVEAT = ("data.limit_train={limit} keeps the examples with the smallest keyed hashes: one example more can "
                "displace one other, so for the data set before the limit the guarantee is that of a replace-one "
                "neighbour (an example added and another removed); remove the limit for the plain guarantee")


def _splitter(spec: DataSpec, seed: int, split_key: Optional[int]) -> tuple[_Splitter, list[str]]:
    """The splitter ``spec`` asks for, and the caveats it brings (module doc of :mod:`membership`)."""
    if spec.split == POSITIONS_SPLIT:
        return _Splitter(seed, None), [POSITIONS_CAVEAT]
    if spec.split_seed is not None:
        return _Splitter(seed, derived_split_key(spec.split_seed)), [KNOWN_KEY_CAVEAT.format(where="data.split_seed")]
    if split_key is not None:
        return _Splitter(seed, random_streams.check_seed(split_key)), []
    return _Splitter(seed, derived_split_key(seed)), [KNOWN_KEY_CAVEAT.format(where="derived from the data seed")]


def derived_split_key(seed: int) -> int:
    """The split key of a public ``seed``: the ``split_key`` stream's first draw."""
    return int(random_streams.numpy_rng(seed, "split_key").integers(0, random_streams.MAX_SEED))


def _check_seed(seed: Any) -> int:
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= seed < random_streams.MAX_SEED:
        raise DataError(f"seed must be an integer in [0, 2**63), got {seed!r}; pass e.g. seed=0")
    return int(seed)


def _resolve_classes(classes: Optional[Sequence[ClassRef]], names: list[str]) -> list[int]:
    """Original class ids to keep, in output order."""
    if classes is None:
        return list(range(len(names)))
    kept = []
    for ref in classes:
        if isinstance(ref, int):
            if ref >= len(names):
                raise key_error("classes", f"class id {ref} is out of range for {len(names)} classes",
                                f"use ids 0..{len(names) - 1} or class names")
            kept.append(ref)
        elif ref in names:
            kept.append(names.index(ref))
        else:
            shown = names[:MAX_LISTED_NAMES] + (["..."] if len(names) > MAX_LISTED_NAMES else [])
            raise key_error("classes", f"unknown class name {ref!r}", f"use one of {shown} or class ids")
    if len(set(kept)) != len(kept):
        raise key_error("classes", f"names the same class twice ({list(classes)})", "list each class once")
    return kept


def _check_class_counts(labels: np.ndarray, kept: list[int], names: list[str]) -> None:
    """At least two classes, and every class has training examples (a stray label would otherwise
    add empty classes to the head: one label 255 makes 256 outputs)."""
    if len(kept) < 2:
        raise key_error("classes", f"the data has {len(kept)} class ({names[kept[0]] if kept else 'none'})",
                        "a classifier needs at least 2 classes")
    empty = [kept[k] for k in np.flatnonzero(np.bincount(labels, minlength=len(kept)) == 0)]
    if empty:
        shown = ", ".join(names[k] for k in empty[:5]) + (", ..." if len(empty) > 5 else "")
        raise key_error("classes", f"{len(empty)} of {len(kept)} classes have no training examples ({shown}; "
                        f"labels go up to {len(names) - 1})",
                        "relabel the data to contiguous ids 0..K-1, or list the classes to use in data.classes")


def _select(split: Split, kept: list[int]) -> _Part:
    """Examples of ``split`` in the ``kept`` classes, relabelled by position in ``kept``."""
    size = max(max(kept, default=-1), int(split.labels.max(initial=-1))) + 1
    relabel = np.full(size, -1, dtype=np.int64)
    relabel[kept] = np.arange(len(kept))
    new = relabel[split.labels]
    index = np.flatnonzero(new >= 0)
    return _Part(split, index, new[index].astype(np.int64))


def _test_split(
    raw: RawData, train: _Part, kept: list[int], spec: DataSpec, splitter: _Splitter
) -> tuple[_Part, _Part]:
    if raw.test is not None:
        if spec.test_fraction is not None:
            raise key_error("test_fraction", f"source {spec.source!r} ({raw.name}) has its own test split",
                            "remove data.test_fraction")
        return train, _select(raw.test, kept)
    test, rest = splitter.carve(train, spec.effective_test_fraction, "test_split")
    if len(test.y) == 0 or len(rest.y) == 0:
        raise key_error("test_fraction", f"{spec.effective_test_fraction} of {len(train.y)} examples "
                        "leaves the train or test split empty", "choose a fraction nearer 0.2")
    return rest, test


def image_digests(images) -> set[bytes]:
    """A digest of each image's bytes (as stored, or as loaded): equal images, equal digests."""
    return {hashlib.blake2b(np.ascontiguousarray(image).tobytes(), digest_size=16).digest() for image in images}


def _pixels(parts: dict[str, _Part], spec: DataSpec, name: str,
            digests: Optional[dict] = None) -> dict[str, np.ndarray]:
    """Reads, scales, converts and resizes the selected images of every part; ``digests`` (a dict) gets each
    part's :func:`image_digests` of its images as stored."""
    arrays: dict[str, Optional[np.ndarray]] = {}
    for key, part in parts.items():
        if len(part.index) == 0:
            arrays[key] = None
            if digests is not None:
                digests[key] = set()
            continue
        what = f"{name} ({key} split)"
        stored = part.split.images(part.index)
        if digests is not None:
            digests[key] = image_digests(stored)
        x = to_unit_float(stored, what)
        arrays[key] = resize_images(convert_channels(x, spec.channels, what), spec.image_size)
    shape = arrays["train"].shape[1:]
    for key, x in arrays.items():
        if x is None:
            arrays[key] = np.zeros((0, *shape), np.float32)
        elif x.shape[1:] != shape:
            raise DataError(f"{name}: {key} images are {x.shape[1:]} but train images are {shape}; "
                            "set data.image_size and data.channels to make them agree")
    return arrays


def _statistics(
    x_train: np.ndarray, spec: DataSpec
) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    if spec.normalize == "none":
        return None, None
    if spec.mean is not None:
        return fixed_stats(spec.mean, spec.std, x_train.shape[-1])
    return channel_stats(x_train)
