"""Image folders: one sub-folder per class, optionally under ``train/`` and ``test/``.

Accepted layouts (class names are the folder names, sorted)::

    path/<class>/*.{jpg,jpeg,png}                       (no test split: carved)
    path/train/<class>/...  [+ path/test/<class>/...]   (test classes must occur in train)

With ``data.user_key: folder`` each class folder holds one sub-folder per user (``<class>/<user>/*.png``,
one folder per patient is how such data is often laid out); the sub-folder's name is the user id, the
same name under two classes being the same user.

A single wrapping folder (``path/cifar10/train/...``) is looked through.
Images are decoded lazily, only those selected by the split and limits, with
the channel count of the first image (1 for grayscale, 3 otherwise; alpha is
dropped, other files are converted to match); ``data.channels`` then converts
like for every source.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import numpy as np

from sparta_tf.data.decode import decode_files, file_channels
from sparta_tf.data.errors import DataError, key_error
from sparta_tf.data.raw import RawData, Split
from sparta_tf.data.spec import DataSpec

__all__ = ["IMAGE_SUFFIXES", "FileSplit", "load_folder", "load_image_tree"]

IMAGE_SUFFIXES: frozenset[str] = frozenset({".jpg", ".jpeg", ".png"})
"""File suffixes (any case) read as images; other files are ignored."""


@dataclasses.dataclass
class FileSplit(Split):
    """Image files and their labels; decoded on :meth:`images`."""

    paths: np.ndarray
    labels: np.ndarray
    channels: int
    image_size: Optional[tuple[int, int]]
    users: Optional[np.ndarray] = None
    class_names: tuple[str, ...] = ()

    def images(self, indices: np.ndarray) -> np.ndarray:
        return decode_files(self.paths[indices].tolist(), self.channels, self.image_size)

    def content_keys(self, indices: np.ndarray) -> list[bytes]:
        """What a stable split hashes of each example at ``indices`` (:mod:`sparta_tf.data.membership`): its
        class folder's name and its file's bytes, neither of which another file can change."""
        keys = []
        for label, path in zip(np.asarray(self.labels)[indices], self.paths[indices]):
            with open(path, "rb") as f:
                keys.append(b"file|" + self.class_names[label].encode() + b"|" + f.read())
        return keys


def load_folder(spec: DataSpec, seed: int) -> RawData:
    """Lists the images under ``spec.path``."""
    if not spec.path.is_dir():
        raise key_error("path", f"no such directory {str(spec.path)!r}",
                        "point data.path at a folder of <class>/ image folders")
    return load_image_tree(spec.path, spec, spec.path.name)


def load_image_tree(root: Path, spec: DataSpec, name: str) -> RawData:
    """Lists the images under ``root`` (either layout) as a :class:`RawData`."""
    root = _unwrap(root)
    by_user = spec.user_key is not None
    if (root / "train").is_dir():
        train_files = _class_files(root / "train", by_user)
        test_files = _class_files(root / "test", by_user) if (root / "test").is_dir() else None
    else:
        train_files, test_files = _class_files(root, by_user), None
    names = sorted(train_files)
    if test_files is not None and set(test_files) - set(names):
        extra = sorted(set(test_files) - set(names))
        raise DataError(
            f"{root}/test has classes {extra} that {root}/train lacks; add them to train or remove them"
        )
    first = next((files[0][0] for files in train_files.values() if files), None)
    if first is None:
        raise key_error("path", f"no .jpg/.jpeg/.png images under {root}", "check data.path")
    # every file is decoded at data.channels when it is given (each image converted on its own); else at the
    # first file's count, read off the private data (a caveat): one grayscale file sorting first would
    # otherwise turn every colour image grey, data.channels or not
    channels = spec.channels if spec.channels is not None else file_channels(Path(first))
    train = _file_split(train_files, names, channels, spec.image_size, by_user)
    test = None if test_files is None else _file_split(test_files, names, channels, spec.image_size, by_user)
    # the class folders are the private data's: caveats unless data.classes (and data.channels) are given
    return RawData(train, test, names, name, class_names_from_labels=True, channels_from_data=spec.channels is None,
                   class_ids_are_folder_ranks=True)


def _unwrap(root: Path) -> Path:
    """Descends into a lone sub-folder that holds folders rather than images."""
    entries = _visible(root)
    while len(entries) == 1 and entries[0].is_dir() and entries[0].name not in ("train", "test"):
        inner = entries[0]
        if any(_is_image(p) for p in _visible(inner)):
            break
        root, entries = inner, _visible(inner)
    return root


def _class_files(directory: Path, by_user: bool = False) -> dict[str, list[tuple[str, Optional[str]]]]:
    """Per class folder, its images as ``(path, user)``: the user sub-folder's name with ``by_user``, else None."""
    classes = {d.name: (_user_files(d) if by_user else [(p, None) for p in _image_files(d)])
               for d in _visible(directory) if d.is_dir()}
    if not classes:
        raise key_error("path", f"{directory} has no class sub-folders",
                        "arrange images as <class>/<image>.png (optionally under train/ and test/)")
    return classes


def _user_files(class_dir: Path) -> list[tuple[str, Optional[str]]]:
    """The images of ``class_dir``'s user sub-folders, ``(path, user)``; images outside one are refused."""
    loose = _image_files(class_dir)
    if loose:
        raise key_error("user_key", f"{class_dir} holds {len(loose)} images outside a user sub-folder "
                        f"(e.g. {Path(loose[0]).name})", "move each image into <class>/<user>/, or remove "
                        "data.user_key")
    return [(path, user.name) for user in _visible(class_dir) if user.is_dir() for path in _image_files(user)]


def _file_split(files: dict[str, list[tuple[str, Optional[str]]]], names: list[str], channels: int,
                image_size: Optional[tuple[int, int]], by_user: bool = False) -> FileSplit:
    listed = [(label, path, user) for label, name in enumerate(names) for path, user in files.get(name, [])]
    paths = np.array([path for _, path, _ in listed], dtype=object)
    labels = np.array([label for label, _, _ in listed], dtype=np.int64)
    users = np.array([user for _, _, user in listed], dtype=str) if by_user else None
    return FileSplit(paths, labels, channels, image_size, users, tuple(names))


def _visible(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if not p.name.startswith("."))


def _image_files(directory: Path) -> list[str]:
    """Sorted paths of the image files directly inside ``directory``."""
    with os.scandir(directory) as entries:
        return sorted(
            entry.path
            for entry in entries
            if not entry.name.startswith(".")
            and os.path.splitext(entry.name)[1].lower() in IMAGE_SUFFIXES
            and entry.is_file()
        )


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()
