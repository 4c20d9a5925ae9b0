"""Tests of sparta_tf.data: every source on tiny files written here, splits, transforms, errors."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from sparta_tf.data import DataError, Dataset, augment, load_dataset, make_augmenter
from sparta_tf.data.sources import archive

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
MNIST_NPZ = SHARED / "mnist.npz"
CIFAR_TAR = SHARED / "cifar10-jpg.tar.gz"
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")  # Debian package dataset-fashion-mnist
SHADES = {"ant": 0, "cat": 40, "dog": 80}


# --------------------------------------------------------------------------
# Writers for tiny test files.
# --------------------------------------------------------------------------


def coded_images(ids: np.ndarray, labels: np.ndarray, size=(4, 4)) -> np.ndarray:
    """uint8 [N, H, W] images encoding (label, id).

    All pixels are ``label * 20`` except ``[0, 1] = id % 256`` and ``[0, 2] = id // 256``.
    """
    x = np.zeros((len(ids), *size), np.uint8)
    x[:, :, :] = (labels * 20)[:, None, None].astype(np.uint8)
    x[:, 0, 1] = ids % 256
    x[:, 0, 2] = ids // 256
    return x


def decode_ids(x: np.ndarray) -> np.ndarray:
    pixels = np.rint(x[:, 0, :3, 0] * 255).astype(np.int64)
    return pixels[:, 1] + 256 * pixels[:, 2]


def decode_labels(x: np.ndarray) -> np.ndarray:
    return np.rint(x[:, -1, -1, 0] * 255 / 20).astype(np.int64)


def write_npz(path: Path, n_train=200, n_test=50, classes=5, test=True, **extra) -> Path:
    y_train = np.arange(n_train) % classes
    arrays = {"x_train": coded_images(np.arange(n_train), y_train), "y_train": y_train.astype(np.uint8)}
    if test:
        y_test = np.arange(n_test) % classes
        arrays.update(x_test=coded_images(np.arange(n_test) + 1000, y_test), y_test=y_test)
    np.savez(path, **arrays, **extra)
    return path


def write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def write_image(path: Path, image: np.ndarray) -> None:
    encode = tf.io.encode_png if path.suffix == ".png" else tf.io.encode_jpeg
    path.parent.mkdir(parents=True, exist_ok=True)
    tf.io.write_file(str(path), encode(image))


def write_folder(root: Path, classes=("cat", "dog", "ant"), per_class=6, size=(5, 5), suffix=".png"):
    """``root/<class>/i.png``; all pixels are SHADES[class] (ant 0, cat 40, dog 80) but pixel [0, 0], which is
    ``SHADES[class] + i`` (no two images alike: identical files share a split)."""
    for name in classes:
        for i in range(per_class):
            image = np.full((*size, 3), SHADES.get(name, 0), np.uint8)
            image[0, 0] += i
            write_image(root / name / f"{i}{suffix}", image)
    return root


def write_tar(source: Path, archive_path: Path) -> Path:
    with tarfile.open(archive_path, "w:gz") as tar:
        tar.add(source, arcname=source.name)
    return archive_path


def split_ids(data: Dataset) -> tuple[set, set, set]:
    return tuple(set(decode_ids(x).tolist()) for x in (data.x_train, data.x_val, data.x_test))


# --------------------------------------------------------------------------
# Sources.
# --------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_learnable():
    spec = {"source": "synthetic", "num_examples": 400, "num_classes": 4, "split": "positions"}
    spec.update(image_size=[6, 6], channels=1)
    a, b = load_dataset(spec, seed=3), load_dataset(spec, seed=3)
    assert a.input_shape == (6, 6, 1) and a.num_classes == 4 and len(a.class_names) == 4
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.x_train, load_dataset(spec, seed=4).x_train)
    assert len(a.y_train) + len(a.y_val) + len(a.y_test) == 400 and len(a.y_test) == 80
    flat = a.x_train.reshape(len(a.x_train), -1)
    centroids = np.stack([flat[a.y_train == k].mean(0) for k in range(4)])
    test = a.x_test.reshape(len(a.x_test), -1)
    predicted = np.argmin(((test[:, None] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (predicted == a.y_test).mean() > 0.9


def test_digits_source():
    data = load_dataset({"source": "digits", "split": "positions"})
    assert data.input_shape == (8, 8, 1) and data.class_names == [str(k) for k in range(10)]
    assert len(data.y_test) == 359 and len(data.y_val) == 144 and len(data.y_train) == 1797 - 359 - 144
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0


def test_npz_grayscale_uint8_gets_channel_axis_and_scaling(tmp_path):
    path = write_npz(tmp_path / "toy.npz", class_names=np.array(list("abcde")))
    data = load_dataset({"source": "npz", "path": str(path), "val_fraction": 0.0})
    assert data.name == "toy" and data.class_names == list("abcde") and data.num_classes == 5
    assert data.x_train.shape == (200, 4, 4, 1) and data.x_test.shape == (50, 4, 4, 1)
    assert data.x_val.shape == (0, 4, 4, 1)
    assert np.array_equal(decode_labels(data.x_train), data.y_train)  # images stay with their labels
    assert sorted(decode_ids(data.x_test)) == list(range(1000, 1050))


@pytest.mark.parametrize("named_by", [None, "classes", "class_names", "stored"])
def test_a_class_count_read_off_the_private_labels_is_a_privacy_caveat(tmp_path, named_by):
    """Without names or classes, K = largest label + 1: removing the only example of the top class
    would shrink the model's head. The data set says so unless the spec or the file fixed the classes."""
    extra = {"class_names": np.array(list("abcde"))} if named_by == "stored" else {}
    path = write_npz(tmp_path / "toy.npz", **extra)
    spec = {"source": "npz", "path": str(path), "val_fraction": 0.0}
    spec.update({"classes": {"classes": [0, 1, 2, 3, 4]}, "class_names": {"class_names": list("abcde")}}
                .get(named_by, {}))
    caveats = [c for c in load_dataset(spec).privacy_caveats() if "data split's key is known" not in c]
    if named_by is None:
        assert len(caveats) == 1 and "number of classes (5) was read off the private labels" in caveats[0]
    else:
        assert caveats == []


def test_npz_float_pixels_outside_unit_range_are_rejected(tmp_path):
    path = tmp_path / "bad.npz"
    x_test, y_test = np.zeros((2, 2, 2)), [0, 1]
    np.savez(path, x_train=np.full((4, 2, 2), 255.0), y_train=np.arange(4), x_test=x_test, y_test=y_test)
    with pytest.raises(DataError, match=r"outside \[0, 1\]"):
        load_dataset({"source": "npz", "path": str(path)})


def test_idx_directory_gz_and_plain(tmp_path):
    y_train, y_test = np.arange(30) % 3, np.arange(9) % 3
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", coded_images(np.arange(30), y_train))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", y_train)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", coded_images(np.arange(9) + 500, y_test))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", y_test)
    data = load_dataset({"source": "idx", "path": str(tmp_path), "class_names": ["x", "y", "z"]})
    assert data.x_train.shape[1:] == (4, 4, 1) and len(data.y_test) == 9
    assert data.class_names == ["x", "y", "z"]
    assert np.array_equal(decode_labels(data.x_train), data.y_train)
    assert sorted(decode_ids(data.x_test)) == list(range(500, 509))


def test_idx_missing_or_corrupt_files(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", coded_images(np.arange(4), np.zeros(4, int)))
    with pytest.raises(DataError, match=r"data\.path: .*train-labels-idx1-ubyte"):
        load_dataset({"source": "idx", "path": str(tmp_path)})
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x09abc")
    with pytest.raises(DataError, match="truncated"):
        load_dataset({"source": "idx", "path": str(tmp_path)})


def test_folder_flat_layout_sorted_names(tmp_path):
    root = write_folder(tmp_path / "pets")
    data = load_dataset({"source": "folder", "path": str(root), "test_fraction": 0.5, "val_fraction": 0.0,
                         "split": "positions"})
    assert data.class_names == ["ant", "cat", "dog"] and data.name == "pets"
    assert data.x_train.shape == (9, 5, 5, 3) and data.x_test.shape == (9, 5, 5, 3)
    assert np.allclose(data.x_train[:, -1, -1, 0] * 255, 40 * data.y_train)
    assert np.bincount(data.y_test).tolist() == [3, 3, 3]  # stratified carve


def test_folder_train_test_layout_and_mixed_sizes(tmp_path):
    write_folder(tmp_path / "d" / "train", per_class=4, size=(6, 6), suffix=".jpg")
    write_folder(tmp_path / "d" / "test", classes=("cat", "dog"), per_class=2, size=(8, 8), suffix=".jpeg")
    spec = {"source": "folder", "path": str(tmp_path / "d")}
    with pytest.raises(DataError, match=r"data\.image_size"):
        load_dataset(spec)
    data = load_dataset({**spec, "image_size": [7, 7], "channels": 1})
    assert data.class_names == ["ant", "cat", "dog"] and data.input_shape == (7, 7, 1)
    assert len(data.y_train) + len(data.y_val) == 12 and sorted(data.y_test.tolist()) == [1, 1, 2, 2]
    assert np.allclose(data.x_test[:, 3, 3, 0] * 255, 40 * data.y_test, atol=3)  # JPEG is lossy


def test_folder_rejects_test_classes_missing_from_train(tmp_path):
    write_folder(tmp_path / "train", classes=("a",), per_class=2)
    write_folder(tmp_path / "test", classes=("b",), per_class=2)
    with pytest.raises(DataError, match=r"classes \['b'\]"):
        load_dataset({"source": "folder", "path": str(tmp_path)})


def test_tar_extracts_once_and_reuses_cache(tmp_path, monkeypatch):
    tar_path = write_tar(write_folder(tmp_path / "src" / "shapes"), tmp_path / "shapes.tar.gz")
    cache = tmp_path / "cache"
    spec = {"source": "tar", "path": str(tar_path), "cache_dir": str(cache)}
    first = load_dataset(spec)
    assert first.name == "shapes" and first.class_names == ["ant", "cat", "dog"]
    assert [p.name.startswith("shapes-") for p in cache.iterdir()] == [True]

    def no_extraction(*args, **kwargs):
        raise AssertionError("the cache was not reused")

    monkeypatch.setattr(archive, "_extract", no_extraction)
    second = load_dataset(spec)
    assert np.array_equal(first.x_train, second.x_train) and np.array_equal(first.y_test, second.y_test)


def test_tar_extraction_is_private_and_another_users_is_not_read(tmp_path, monkeypatch):
    """The extracted images are the private data: 0700; an extraction of the same name owned by someone else
    (its name follows from the archive's path, size and time) is refused."""
    tar_path = write_tar(write_folder(tmp_path / "src" / "shapes"), tmp_path / "shapes.tar.gz")
    spec = {"source": "tar", "path": str(tar_path), "cache_dir": str(tmp_path / "cache")}
    load_dataset(spec)
    (extracted,) = (tmp_path / "cache").iterdir()
    assert extracted.stat().st_mode & 0o077 == 0
    monkeypatch.setattr(archive.os, "getuid", lambda: extracted.stat().st_uid + 1)
    with pytest.raises(DataError, match=r"data\.cache_dir: the extracted archive .* belongs to another user"):
        load_dataset(spec)


def test_tar_corrupt_archive_leaves_no_cache(tmp_path):
    source = write_folder(tmp_path / "src" / "s", per_class=30, size=(16, 16))
    good = write_tar(source, tmp_path / "good.tgz")
    bad = tmp_path / "bad.tgz"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"data\.path: cannot extract"):
        load_dataset({"source": "tar", "path": str(bad), "cache_dir": str(cache)})
    assert list(cache.iterdir()) == []


def test_tar_interrupted_extraction_leaves_no_cache(tmp_path, monkeypatch):
    tar_path = write_tar(write_folder(tmp_path / "src" / "s"), tmp_path / "s.tar.gz")
    cache = tmp_path / "cache"
    real_extract = archive._extract

    def interrupted(source, target):
        (target / "half").write_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(archive, "_extract", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_dataset({"source": "tar", "path": str(tar_path), "cache_dir": str(cache)})
    assert list(cache.iterdir()) == []
    # A partial folder left by a killed process (pid no longer running) is swept away.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cache / f".{archive.cache_key(tar_path)}.partial-{dead.pid}-xyz"
    stale.mkdir()
    monkeypatch.setattr(archive, "_extract", real_extract)
    data = load_dataset({"source": "tar", "path": str(tar_path), "cache_dir": str(cache)})
    assert data.num_classes == 3 and not stale.exists()
    assert [p.name for p in cache.iterdir()] == [archive.cache_key(tar_path)]


# --------------------------------------------------------------------------
# Classes, splits, limits, pixels, normalisation.
# --------------------------------------------------------------------------


def test_classes_keep_and_relabel_in_given_order(tmp_path):
    path = write_npz(tmp_path / "t.npz", class_names=np.array(list("abcde")))
    data = load_dataset({"source": "npz", "path": str(path), "classes": [3, "b"]})
    assert data.class_names == ["d", "b"] and data.num_classes == 2
    for x, y in ((data.x_train, data.y_train), (data.x_test, data.y_test)):
        assert np.array_equal(decode_labels(x), np.where(y == 0, 3, 1))
    assert len(data.y_train) + len(data.y_val) == 80 and len(data.y_test) == 20


def test_split_determinism_disjointness_and_stratification(tmp_path):
    path = write_npz(tmp_path / "t.npz", n_train=300, test=False, classes=3)
    spec = {"source": "npz", "path": str(path), "val_fraction": 0.2, "test_fraction": 0.1, "split": "positions"}
    train, val, test = split_ids(load_dataset(spec, seed=1))
    assert not (train & val or train & test or val & test) and train | val | test == set(range(300))
    assert (len(train), len(val), len(test)) == (216, 54, 30)
    assert split_ids(load_dataset(spec, seed=1)) == (train, val, test)
    assert split_ids(load_dataset(spec, seed=2)) != (train, val, test)
    data = load_dataset(spec, seed=1)
    assert np.bincount(data.y_val).tolist() == [18, 18, 18]
    assert np.bincount(data.y_test).tolist() == [10, 10, 10]


def test_limits_are_deterministic_and_keep_the_test_split(tmp_path):
    path = write_npz(tmp_path / "t.npz", n_train=300, test=False, classes=3)
    base = {"source": "npz", "path": str(path), "split": "positions"}
    full = load_dataset(base, seed=5)
    limited = load_dataset({**base, "limit_train": 40, "limit_test": 12}, seed=5)
    assert len(limited.y_train) + len(limited.y_val) == 40 and len(limited.y_val) == 4
    assert len(limited.y_test) == 12 and np.bincount(limited.y_test).tolist() == [4, 4, 4]
    assert split_ids(limited)[2] <= split_ids(full)[2]  # test examples come from the same carved test split
    assert split_ids(limited)[0] <= split_ids(full)[0] | split_ids(full)[1]
    again = load_dataset({**base, "limit_train": 40, "limit_test": 12}, seed=5)
    assert split_ids(limited) == split_ids(again)
    big = load_dataset({**base, "limit_train": 10_000}, seed=5)
    assert len(big.y_train) == len(full.y_train)


def test_resize_and_channel_conversion(tmp_path):
    root = tmp_path / "rgb"
    rng = np.random.default_rng(0)
    for k in range(2):
        for i in range(5):
            write_image(root / f"c{k}" / f"{i}.png", rng.integers(0, 256, (4, 4, 3), dtype=np.uint8))
    spec = {"source": "folder", "path": str(root), "val_fraction": 0.0, "split": "positions"}
    rgb = load_dataset(spec)
    gray = load_dataset({**spec, "channels": 1})
    luma = rgb.x_train @ np.array([0.2989, 0.587, 0.114], np.float32)
    assert gray.input_shape == (4, 4, 1) and np.allclose(gray.x_train[..., 0], luma, atol=1e-6)
    resized = load_dataset({**spec, "image_size": [8, 6]})
    expected = tf.image.resize(rgb.x_train, [8, 6], method="bilinear").numpy()
    assert resized.input_shape == (8, 6, 3) and np.allclose(resized.x_train, expected, atol=1e-5)
    digits_rgb = load_dataset({"source": "digits", "channels": 3, "image_size": [16, 16], "split": "positions"})
    assert digits_rgb.input_shape == (16, 16, 3)
    assert np.array_equal(digits_rgb.x_train[..., 0], digits_rgb.x_train[..., 2])


def test_standard_normalisation_uses_train_split_only(tmp_path):
    spec = {"source": "synthetic", "num_examples": 500, "channels": 3, "val_fraction": 0.2}
    raw = load_dataset(spec, seed=2)
    data = load_dataset({**spec, "normalize": "standard"}, seed=2)
    mean = raw.x_train.mean(axis=(0, 1, 2), dtype=np.float64)
    std = raw.x_train.std(axis=(0, 1, 2), dtype=np.float64)
    assert np.allclose(data.mean, mean, atol=1e-6) and np.allclose(data.std, std, atol=1e-6)
    everything = np.concatenate([raw.x_train, raw.x_val, raw.x_test])
    assert not np.allclose(data.mean, everything.mean(axis=(0, 1, 2)), atol=1e-7, rtol=0)
    assert np.allclose(data.x_train.mean(axis=(0, 1, 2)), 0, atol=1e-4)
    assert np.allclose(data.x_train.std(axis=(0, 1, 2)), 1, atol=1e-4)
    assert np.allclose(data.x_test, (raw.x_test - data.mean) / data.std, atol=1e-5)
    fixed = load_dataset({**spec, "normalize": "standard", "mean": [0.5] * 3, "std": [0.25] * 3}, seed=2)
    assert np.allclose(fixed.x_val, (raw.x_val - 0.5) / 0.25) and fixed.mean.tolist() == [0.5] * 3


# --------------------------------------------------------------------------
# TFDS.
# --------------------------------------------------------------------------


class SpartaTinyImages(tfds.core.GeneratorBasedBuilder):
    """A 3-class, 4x4 grayscale builder prepared locally (no download)."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(4, 4, 1)),
                    "label": tfds.features.ClassLabel(names=["r", "s", "t"]),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(24, 0), "test": self._generate_examples(6, 100)}

    def _generate_examples(self, count, offset):
        for i in range(count):
            label = i % 3
            yield i + offset, {"image": np.full((4, 4, 1), 20 * label, np.uint8), "label": label}


def test_tfds_not_prepared_fails_fast_offline(tmp_path):
    start = time.monotonic()
    with pytest.raises(DataError) as error:
        load_dataset({"source": "tfds", "name": "mnist", "data_dir": str(tmp_path / "tfds")})
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert "\n" not in message and message.startswith("data.name: TFDS data set 'mnist' is not prepared")
    assert "data.download: true" in message and "data.data_dir" in message and str(tmp_path) in message


def test_tfds_unknown_name_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"^data\.name: TFDS cannot open 'no_such_set_xyz'[^\n]*$"):
        load_dataset({"source": "tfds", "name": "no_such_set_xyz", "data_dir": str(tmp_path)})


def test_tfds_prepared_builder_loads(tmp_path):
    spec = {"source": "tfds", "name": "sparta_tiny_images", "data_dir": str(tmp_path)}
    with pytest.raises(DataError, match="not prepared"):
        load_dataset(spec)
    load_dataset({**spec, "download": True})  # prepares locally: the builder downloads nothing
    data = load_dataset({**spec, "classes": ["t", "r"], "image_size": [2, 2]})
    assert data.name == "sparta_tiny_images" and data.class_names == ["t", "r"]
    assert data.input_shape == (2, 2, 1)
    assert len(data.y_train) + len(data.y_val) == 16 and len(data.y_test) == 4
    assert np.allclose(data.x_train[:, 0, 0, 0] * 255, np.where(data.y_train == 0, 40, 0), atol=1e-3)


# --------------------------------------------------------------------------
# Spec validation.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, key",
    [
        ({"source": "csv"}, "source"),
        ({"path": "x.npz"}, "source"),
        ({"source": "digits", "val_fraktion": 0.1}, "val_fraktion"),
        ({"source": "digits", "path": "x"}, "path"),
        ({"source": "npz"}, "path"),
        ({"source": "tfds"}, "name"),
        ({"source": "digits", "val_fraction": 1.0}, "val_fraction"),
        ({"source": "digits", "test_fraction": 0}, "test_fraction"),
        ({"source": "digits", "limit_train": 0}, "limit_train"),
        ({"source": "digits", "limit_test": True}, "limit_test"),
        ({"source": "digits", "image_size": [8]}, "image_size"),
        ({"source": "digits", "channels": 4}, "channels"),
        ({"source": "digits", "normalize": "minmax"}, "normalize"),
        ({"source": "digits", "normalize": "standard", "mean": [0.1]}, "std"),
        ({"source": "digits", "mean": [0.1], "std": [0.2]}, "normalize"),
        ({"source": "digits", "normalize": "standard", "mean": [0.1, 0.2, 0.3], "std": [1, 1, 1]}, "mean"),
        ({"source": "digits", "classes": []}, "classes"),
        ({"source": "digits", "classes": [1, 1]}, "classes"),
        ({"source": "digits", "classes": [10]}, "classes"),
        ({"source": "digits", "classes": ["seven"]}, "classes"),
        ({"source": "digits", "classes": [1.5]}, "classes"),
        ({"source": "tfds", "name": "mnist", "download": "no"}, "download"),
        ({"source": "synthetic", "num_classes": 1}, "num_classes"),
        ({"source": "npz", "path": "/nonexistent/file.npz"}, "path"),
        ({"source": "tar", "path": "/nonexistent/file.tgz"}, "path"),
        ({"source": "folder", "path": "/nonexistent"}, "path"),
        ({"source": "idx", "path": "/nonexistent"}, "path"),
    ],
)
def test_bad_specs_raise_one_line_errors_naming_the_key(spec, key):
    with pytest.raises(DataError) as error:
        load_dataset(spec)
    message = str(error.value)
    assert message.startswith(f"data.{key}:") and "\n" not in message and ";" in message


def test_bad_spec_container_and_seed():
    with pytest.raises(DataError, match="mapping"):
        load_dataset(["digits"])
    with pytest.raises(DataError, match="seed"):
        load_dataset({"source": "digits"}, seed=-1)


def test_test_fraction_rejected_for_sources_with_a_test_split(tmp_path):
    path = write_npz(tmp_path / "t.npz")
    with pytest.raises(DataError, match=r"^data\.test_fraction: .*own test split"):
        load_dataset({"source": "npz", "path": str(path), "test_fraction": 0.3})


# --------------------------------------------------------------------------
# Augmentation (non-private pre-training only).
# --------------------------------------------------------------------------


def test_augment_is_deterministic_by_seed_and_identity_at_inference():
    x = np.random.default_rng(0).random((16, 8, 8, 3)).astype(np.float32)
    a, b = augment(x, seed=1), augment(x, seed=1)
    assert a.shape == x.shape and np.array_equal(a, b) and not np.array_equal(a, x)
    assert not np.array_equal(a, augment(x, seed=2))
    assert np.array_equal(augment(x, flip=False, max_shift=0.0), x)
    assert np.array_equal(make_augmenter(seed=0)(x, training=False).numpy(), x)
    with pytest.raises(DataError, match="max_shift"):
        make_augmenter(max_shift=1.5)


# --------------------------------------------------------------------------
# Shared offline data (skipped where absent).
# --------------------------------------------------------------------------


@pytest.mark.skipif(not MNIST_NPZ.is_file(), reason=f"{MNIST_NPZ} not present")
def test_shared_mnist_npz():
    spec = {"source": "npz", "path": str(MNIST_NPZ), "limit_train": 1000, "normalize": "standard", "split": "positions"}
    data = load_dataset(spec)
    assert data.name == "mnist" and data.num_classes == 10 and data.input_shape == (28, 28, 1)
    assert data.x_train.shape == (900, 28, 28, 1) and data.x_val.shape == (100, 28, 28, 1)
    assert data.x_test.shape == (3000, 28, 28, 1) and np.bincount(data.y_train, minlength=10).min() > 70
    assert abs(float(data.mean[0]) - 0.1307) < 0.01 and abs(float(data.std[0]) - 0.3081) < 0.01


@pytest.mark.skipif(not FASHION_MNIST.is_dir(), reason=f"{FASHION_MNIST} not present")
def test_debian_fashion_mnist_idx():
    data = load_dataset({"source": "idx", "path": str(FASHION_MNIST), "limit_train": 2000, "classes": [5, 6]})
    assert data.name == "fashion-mnist" and data.input_shape == (28, 28, 1) and data.num_classes == 2
    assert data.x_train.shape == (1800, 28, 28, 1) and np.bincount(data.y_test).tolist() == [1000, 1000]


@pytest.mark.skipif(not CIFAR_TAR.is_file(), reason=f"{CIFAR_TAR} not present")
def test_shared_cifar10_tar():
    # The default cache (<tmp>/sparta_tf_data-<uid>) is reused across runs: only the first run extracts
    # the 60k JPEGs (about 10-20 s); later runs take about a second.
    spec = {
        "source": "tar",
        "path": str(CIFAR_TAR),
        "classes": [0, 1],
        "limit_train": 500,
        "limit_test": 200,
        "split": "positions",
    }
    data = load_dataset(spec)
    assert data.name == "cifar10-jpg" and data.class_names == ["airplane", "automobile"]
    assert data.x_train.shape == (450, 32, 32, 3) and data.x_val.shape == (50, 32, 32, 3)
    assert data.x_test.shape == (200, 32, 32, 3) and np.bincount(data.y_test).tolist() == [100, 100]
    assert 0.3 < float(data.x_train.mean()) < 0.7
