"""A TensorFlow Datasets (TFDS) image-classification data set, read offline by default.

With ``download: false`` (the default) the data set must already be prepared
in ``data_dir``; otherwise a one-line :class:`DataError` says so at once:
nothing is fetched and nothing retries. ``download: true`` calls
``download_and_prepare`` (needs network access).

The ``train`` split is the training data; ``test`` (when the data set has
one) the test data. Images and labels come from the data set's supervised
keys; class names from its ``ClassLabel`` feature; with ``data.user_key``, each image's user id
from that feature (an int or a text feature).
"""

from __future__ import annotations

import numpy as np

from sparta_tf.data.errors import DataError, key_error
from sparta_tf.data.raw import ArraySplit, RawData, check_labels, check_users
from sparta_tf.data.spec import DataSpec

__all__ = ["load_tfds"]

DEFAULT_DATA_DIR_TEXT = "the default TFDS data_dir (~/tensorflow_datasets)"

BATCH = 4096
"""Examples read per ``tf.data`` batch."""


def load_tfds(spec: DataSpec, seed: int) -> RawData:
    """Loads ``spec.name`` from ``spec.data_dir`` (preparing it only if ``spec.download``)."""
    builder = _builder(spec)
    if not builder.is_prepared():
        if not spec.download:
            where = str(spec.data_dir) if spec.data_dir else DEFAULT_DATA_DIR_TEXT
            raise key_error(
                "name", f"TFDS data set {spec.name!r} is not prepared in {where}",
                "set data.download: true on a machine with network access, "
                "or point data.data_dir at a folder holding a prepared copy",
            )
        _download_and_prepare(builder, spec)
    info = builder.info
    if not info.supervised_keys or len(info.supervised_keys) != 2:
        raise key_error("name", f"TFDS data set {spec.name!r} has no (image, label) supervised keys",
                        "use an image-classification data set")
    image_key, label_key = info.supervised_keys
    label_feature = info.features[label_key]
    if spec.user_key is not None and spec.user_key not in info.features:
        raise key_error("user_key", f"TFDS data set {spec.name!r} has no feature {spec.user_key!r} (features: "
                        f"{sorted(info.features)})", "name the feature that holds each image's user id")
    keys = (image_key, label_key, spec.user_key)
    train = _split(builder, "train", spec, keys)
    test = _split(builder, "test", spec, keys) if "test" in info.splits else None
    num_classes = getattr(label_feature, "num_classes", None)
    names = list(getattr(label_feature, "names", None) or [])
    from_labels = not names and not num_classes
    if not names:
        top = max(int(s.labels.max()) for s in (train, test) if s is not None and s.labels.size)
        names = [str(k) for k in range(num_classes or top + 1)]
    return RawData(train, test, names, spec.name, from_labels)


def _builder(spec: DataSpec):
    import tensorflow_datasets as tfds

    data_dir = str(spec.data_dir) if spec.data_dir else None
    try:
        return tfds.builder(spec.name, data_dir=data_dir)
    except Exception as error:  # noqa: BLE001 - TFDS raises many types; report them all in one line
        raise key_error("name", f"TFDS cannot open {spec.name!r} ({_one_line(error)})",
                        "check the data set name, e.g. mnist, cifar10 or fashion_mnist") from None


NETWORK_PROBE = ("storage.googleapis.com", 443)
NETWORK_TIMEOUT_S = 3.0


def _reachable(host_port: tuple[str, int] = NETWORK_PROBE, timeout: float = NETWORK_TIMEOUT_S) -> bool:
    """Whether TFDS's download host answers within ``timeout`` (TFDS itself retries for minutes)."""
    import socket

    try:
        with socket.create_connection(host_port, timeout=timeout):
            return True
    except OSError:
        return False


def _downloads(builder) -> bool:
    """Catalog builders (``tensorflow_datasets.*``) fetch their files; builders of your own may prepare
    from local files only, so they are not refused offline."""
    return type(builder).__module__.startswith("tensorflow_datasets.")


def _download_and_prepare(builder, spec: DataSpec) -> None:
    if _downloads(builder) and not _reachable():
        raise key_error("download", f"TFDS data set {spec.name!r} is not prepared in {builder.data_dir} and "
                        f"{NETWORK_PROBE[0]} is unreachable (offline)",
                        "prepare it on a machine with network access and copy its data_dir here")
    try:
        builder.download_and_prepare()
    except Exception as error:  # noqa: BLE001 - network, disk and TFDS errors alike
        raise key_error("download", f"preparing TFDS data set {spec.name!r} failed ({_one_line(error)})",
                        "check network access, or prepare it elsewhere and point data.data_dir at it") from None


def _one_line(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _split(builder, split: str, spec: DataSpec, keys: tuple) -> ArraySplit:
    """The images, labels and (``keys[2]`` not None) user ids of ``split``; ``keys``: the image, label and
    user features."""
    import tensorflow as tf

    image_key, label_key, user_key = keys
    shape = builder.info.features[image_key].shape
    if spec.image_size is None and None in tuple(shape[:2]):
        raise key_error("image_size", f"images of TFDS data set {spec.name!r} vary in size",
                        "set data.image_size, e.g. [224, 224]")

    def prepare(features: dict):
        image = features[image_key]
        if spec.image_size is not None:
            image = tf.image.resize(tf.image.convert_image_dtype(image, tf.float32), spec.image_size)
        user = features[user_key] if user_key is not None else tf.zeros([], tf.int64)
        return image, features[label_key], user

    data = builder.as_dataset(split=split, shuffle_files=False)
    data = data.map(prepare, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH)
    xs, ys, users = [], [], []
    for x, y, user in data.as_numpy_iterator():
        xs.append(x)
        ys.append(y)
        users.append(user)
    if not xs:
        raise DataError(f"TFDS split {spec.name}/{split} is empty; prepare the data set again")
    x = np.concatenate(xs)
    if x.ndim == 3:
        x = x[..., np.newaxis]
    labels = check_labels(np.concatenate(ys), len(x), f"{spec.name}/{split} labels")
    if user_key is None:
        return ArraySplit(x, labels)
    ids = np.concatenate(users)
    ids = np.char.decode(ids.astype(bytes), "utf-8") if ids.dtype.kind in "OS" else ids
    return ArraySplit(x, labels, check_users(ids, len(x), f"{spec.name}/{split} {user_key}"))
