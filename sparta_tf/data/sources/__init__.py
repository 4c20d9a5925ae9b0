"""Data sources: each turns a validated :class:`DataSpec` and a seed into :class:`RawData`."""

from __future__ import annotations

from typing import Callable

from sparta_tf.data.raw import RawData
from sparta_tf.data.sources.archive import load_tar
from sparta_tf.data.sources.digits import load_digits_source
from sparta_tf.data.sources.folder import load_folder
from sparta_tf.data.sources.idx import load_idx
from sparta_tf.data.sources.npz import load_npz
from sparta_tf.data.sources.synthetic import load_synthetic
from sparta_tf.data.sources.tfds_source import load_tfds
from sparta_tf.data.spec import DataSpec

__all__ = ["SOURCES", "SourceLoader"]

SourceLoader = Callable[[DataSpec, int], RawData]

SOURCES: dict[str, SourceLoader] = {
    "synthetic": load_synthetic,
    "digits": load_digits_source,
    "npz": load_npz,
    "idx": load_idx,
    "folder": load_folder,
    "tar": load_tar,
    "tfds": load_tfds,
}
"""``data.source`` value -> loader."""
