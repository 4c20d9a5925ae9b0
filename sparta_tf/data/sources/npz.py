"""A numpy ``.npz`` file with ``x_train``, ``y_train`` and optionally ``x_test``, ``y_test``.

With ``data.user_key: <key>``, the array ``<key>_train`` holds each training image's user id (ints or
strings), for user-level DP; ``<key>_test``, when stored, the test images' (the guarantee does not need
them: the test split is never trained on).

Images are ``[N, H, W]`` (grayscale; a channel axis is added) or
``[N, H, W, C]``, uint8 0..255 or floats in [0, 1]. An optional
``class_names`` array names the classes (else ``data.class_names``, else
``"0" .. "K-1"``).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Optional

import numpy as np

from sparta_tf.data.errors import key_error
from sparta_tf.data.raw import ArraySplit, RawData, check_labels, check_users, images_with_channel_axis
from sparta_tf.data.sources.naming import class_names_for, names_from_labels
from sparta_tf.data.spec import DataSpec

__all__ = ["load_npz"]


def load_npz(spec: DataSpec, seed: int) -> RawData:
    """Reads ``spec.path``; without ``x_test``/``y_test`` the test split is carved."""
    arrays = _read(spec.path)
    train = _split(arrays, "train", spec.path, spec.user_key)
    if train is None:
        raise key_error(
            "path", f"{spec.path} has no x_train/y_train (keys: {sorted(arrays)})",
            "save the file with np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)",
        )
    if len(train.labels) == 0:
        raise key_error("path", f"{spec.path} has 0 training examples (x_train is empty)",
                        "store the training images in x_train and their labels in y_train")
    test = _split(arrays, "test", spec.path, spec.user_key)
    stored = [str(n) for n in arrays["class_names"]] if "class_names" in arrays else None
    names = class_names_for(spec, [train, test], stored)
    return RawData(train, test, names, spec.path.name.removesuffix(".npz"), names_from_labels(spec, stored))


def _read(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise key_error("path", f"no such file {str(path)!r}", "point data.path at an existing .npz file")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise key_error("path", f"cannot read {str(path)!r} as .npz ({error})",
                        "write it with numpy.savez") from None


def _split(arrays: dict[str, np.ndarray], split: str, path: Path, user_key: Optional[str]) -> Optional[ArraySplit]:
    x_key, y_key = f"x_{split}", f"y_{split}"
    if x_key not in arrays and y_key not in arrays:
        return None
    if x_key not in arrays or y_key not in arrays:
        missing = x_key if x_key not in arrays else y_key
        raise key_error("path", f"{path} has no {missing!r}", f"store both {x_key} and {y_key}")
    x = images_with_channel_axis(arrays[x_key], f"{path.name}:{x_key}")
    labels = check_labels(arrays[y_key], len(x), f"{path.name}:{y_key}")
    if user_key is None:
        return ArraySplit(x, labels)
    users_key = f"{user_key}_{split}"
    if users_key not in arrays and split == "test":
        return ArraySplit(x, labels)
    if users_key not in arrays:
        raise key_error("user_key", f"{path} has no {users_key!r} array (keys: {sorted(arrays)})",
                        f"store each image's user id as {users_key}, or fix data.user_key")
    return ArraySplit(x, labels, check_users(arrays[users_key], len(x), f"{path.name}:{users_key}"))
