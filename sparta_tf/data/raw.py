"""What a source returns: labels up front, images on demand.

Splits and limits are chosen from labels alone; only the selected images are
then materialised (:meth:`Split.images`). For image folders this means a
``classes: [0, 1]`` run on CIFAR-10 decodes 10k JPEGs, not 60k.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Optional

import numpy as np

from sparta_tf.data.errors import DataError

__all__ = ["ArraySplit", "RawData", "Split", "check_labels", "check_users", "images_with_channel_axis"]


class Split(abc.ABC):
    """One split (train or test) of a source."""

    labels: np.ndarray
    """int64 class ids, one per example."""

    users: Optional[np.ndarray] = None
    """Each example's user id as a string (``data.user_key``), or None when the source has no users."""

    @abc.abstractmethod
    def images(self, indices: np.ndarray) -> np.ndarray:
        """The images at ``indices`` as ``[n, H, W, C]`` (uint8, or floats in [0, 1])."""


@dataclasses.dataclass
class ArraySplit(Split):
    """A split held in memory."""

    x: np.ndarray
    labels: np.ndarray
    users: Optional[np.ndarray] = None

    def images(self, indices: np.ndarray) -> np.ndarray:
        return self.x[indices]


@dataclasses.dataclass
class RawData:
    """A source's splits (``test`` is ``None`` when it has none) and class names.

    ``class_names_from_labels``: the class set was read off the data (names
    ``"0" .. "K-1"`` with ``K`` one more than the largest label, or the class
    folders of an image tree): nothing public gave it, so it depends on the
    data's examples. ``channels_from_data``: the images' channel count was read
    off one of them (an image tree's first file). ``class_ids_are_folder_ranks``:
    class number ``k`` is the ``k``-th class folder in sorted order, which other
    folders (the private data's) can shift.
    """

    train: Split
    test: Optional[Split]
    class_names: list[str]
    name: str
    class_names_from_labels: bool = False
    channels_from_data: bool = False
    class_ids_are_folder_ranks: bool = False


def images_with_channel_axis(x: np.ndarray, what: str) -> np.ndarray:
    """Returns ``x`` as ``[N, H, W, C]``, adding ``C = 1`` to ``[N, H, W]`` arrays."""
    if x.ndim == 3:
        return x[..., np.newaxis]
    if x.ndim != 4:
        raise DataError(
            f"{what} has shape {x.shape}; store images as [N, H, W] or [N, H, W, C]"
        )
    return x


def check_labels(y: np.ndarray, num_images: int, what: str) -> np.ndarray:
    """Returns ``y`` as int64 ``[N]`` after checking it holds ``num_images`` class ids."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or y.size == 0):
        raise DataError(
            f"{what} has shape {y.shape} and dtype {y.dtype}; store integer class ids of shape [N]"
        )
    if len(y) != num_images:
        raise DataError(f"{what} has {len(y)} labels for {num_images} images; store one label per image")
    if y.size and y.min() < 0:
        raise DataError(f"{what} has negative labels; store class ids 0 .. K-1")
    return y.astype(np.int64)


def check_users(users, num_images: int, what: str) -> np.ndarray:
    """Returns ``users`` as a ``[N]`` array of string ids after checking it holds one usable id per image
    (no empty or missing id, no NaN or infinite number)."""
    users = np.asarray(users)
    if users.ndim == 2 and users.shape[1] == 1:
        users = users[:, 0]
    if users.ndim != 1:
        raise DataError(f"{what} has shape {users.shape}; store one user id per image, shape [N]")
    if len(users) != num_images:
        raise DataError(f"{what} has {len(users)} user ids for {num_images} images; store one user id per image")
    if users.dtype.kind == "f" and not np.all(np.isfinite(users)):
        raise DataError(f"{what} has {int(np.sum(~np.isfinite(users)))} NaN or infinite user ids; give every image "
                        "its user's id")
    if users.dtype.kind == "f" and not np.all(users == np.round(users)):
        raise DataError(f"{what} has fractional user ids; store integer or string ids")
    if users.dtype.kind == "f":
        users = users.astype(np.int64)
    if users.dtype.kind == "O" and any(u is None for u in users):
        raise DataError(f"{what} has missing (None) user ids; give every image its user's id")
    ids = users.astype(str)
    if np.any(ids == ""):
        raise DataError(f"{what} has empty user ids; give every image its user's id")
    return ids
