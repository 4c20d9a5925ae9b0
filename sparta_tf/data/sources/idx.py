"""A directory of MNIST-format IDX files (e.g. MNIST, Fashion-MNIST).

Expected names, each optionally gzipped (``.gz``)::

    train-images-idx3-ubyte  train-labels-idx1-ubyte    (required)
    t10k-images-idx3-ubyte   t10k-labels-idx1-ubyte     (optional; else carved)

Debian's ``dataset-fashion-mnist`` package installs Fashion-MNIST in this
layout under ``/usr/share/datasets/fashion-mnist/``.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from sparta_tf.data.errors import DataError, key_error
from sparta_tf.data.raw import ArraySplit, RawData, check_labels, images_with_channel_axis
from sparta_tf.data.sources.naming import class_names_for, names_from_labels
from sparta_tf.data.spec import DataSpec

__all__ = ["IDX_DTYPES", "load_idx", "read_idx"]

IDX_DTYPES: dict[int, str] = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
"""IDX type codes (third magic byte) and their numpy dtypes."""

SPLITS = {"train": "train", "test": "t10k"}


def load_idx(spec: DataSpec, seed: int) -> RawData:
    """Reads the IDX files in directory ``spec.path``."""
    directory = spec.path
    if not directory.is_dir():
        raise key_error(
            "path", f"no such directory {str(directory)!r}",
            "point data.path at a folder of {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] files",
        )
    train = _split(directory, SPLITS["train"], required=True)
    test = _split(directory, SPLITS["test"], required=False)
    return RawData(train, test, class_names_for(spec, [train, test]), directory.name, names_from_labels(spec))


def _split(directory: Path, prefix: str, required: bool) -> Optional[ArraySplit]:
    image_file = _find(directory, f"{prefix}-images-idx3-ubyte")
    label_file = _find(directory, f"{prefix}-labels-idx1-ubyte")
    if image_file is None and label_file is None and not required:
        return None
    if image_file is None or label_file is None:
        stem = f"{prefix}-images-idx3-ubyte" if image_file is None else f"{prefix}-labels-idx1-ubyte"
        raise key_error("path", f"{directory} has no {stem}[.gz]", "add the file or fix data.path")
    x = images_with_channel_axis(read_idx(image_file), image_file.name)
    return ArraySplit(x, check_labels(read_idx(label_file), len(x), label_file.name))


def _find(directory: Path, stem: str) -> Optional[Path]:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def read_idx(path: Path) -> np.ndarray:
    """Parses one IDX file (gzipped when its name ends in ``.gz``) into an array."""
    try:
        data = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"cannot read IDX file {path}: {error}; re-download or fix the file") from None
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] not in IDX_DTYPES:
        raise DataError(f"{path} is not an IDX file (bad magic number); check data.path")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", data[4:header]) if len(data) >= header else None
    dtype = np.dtype(IDX_DTYPES[data[2]])
    if shape is None or len(data) - header != int(np.prod(shape)) * dtype.itemsize:
        raise DataError(f"{path} is truncated or corrupt (size does not match its header); re-download it")
    return np.frombuffer(data, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))
