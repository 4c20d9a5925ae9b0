"""Stable splits (issue 60): each example's train/validation/test membership is decided on its own (a keyed
hash of its content, :mod:`sparta_tf.data.membership`), so adding, removing or reordering examples changes no
other example's split; ``split: positions`` keeps the old (unstable) splits for pinned benchmarks; a known
key is a caveat, a limit that can displace one example is a caveat."""

import numpy as np
import pytest

from sparta_tf.data import load_dataset
from sparta_tf.data import loader
from test_data import coded_images, decode_ids, write_image

N = 600


def write_source(tmp_path, kind: str, ids: np.ndarray):
    """A data spec of ``kind`` holding the examples ``ids`` (each image encodes its id), in that order."""
    labels = ids % 3
    if kind == "folder":
        root = tmp_path / "folder"
        for i, label in zip(ids, labels):
            image = coded_images(np.array([i]), np.array([label]))[0]
            write_image(root / f"c{label}" / f"{i:05d}.png", np.repeat(image[..., None], 3, axis=-1))
        return {"source": "folder", "path": str(root)}
    arrays = {"x_train": coded_images(ids, labels), "y_train": labels.astype(np.uint8)}
    if kind == "npz-with-test":
        test_ids = np.arange(50) + 5000
        arrays.update(x_test=coded_images(test_ids, test_ids % 3), y_test=(test_ids % 3).astype(np.uint8))
    np.savez(tmp_path / "data.npz", **arrays)
    return {"source": "npz", "path": str(tmp_path / "data.npz")}


def memberships(spec: dict, **kwargs) -> dict:
    """Example id -> "train" / "val" / "test"."""
    data = load_dataset(spec, **kwargs)
    out = {}
    for split, x in (("train", data.x_train), ("val", data.x_val), ("test", data.x_test)):
        out.update({int(i): split for i in decode_ids(x)})
    return out


def moved(before: dict, after: dict) -> int:
    """How many examples present in both moved to another split."""
    return sum(before[i] != after[i] for i in before.keys() & after.keys())


@pytest.mark.parametrize("kind", ["npz", "npz-with-test", "folder"])
def test_adding_removing_or_reordering_examples_changes_no_other_examples_split(tmp_path, kind):
    n = 90 if kind == "folder" else N  # PNG files are slow to write
    ids = np.arange(n)
    common = {"val_fraction": 0.2, **({} if kind == "npz-with-test" else {"test_fraction": 0.2})}

    def splits(ids, where):
        where.mkdir()
        return memberships({**write_source(where, kind, ids), **common}, split_key=1234)

    base = splits(ids, tmp_path / "base")
    assert set(base.values()) == {"train", "val", "test"}
    added = splits(np.append(ids, 7777), tmp_path / "added")
    removed = splits(ids[ids != 17], tmp_path / "removed")
    reordered = splits(np.random.default_rng(0).permutation(ids), tmp_path / "reordered")
    assert moved(base, added) == 0 and 7777 in added
    assert moved(base, removed) == 0 and 17 not in removed
    assert reordered == base


def test_an_image_in_a_new_class_folder_or_a_grayscale_first_image_moves_no_other_image(tmp_path):
    """An image tree's label numbers are folder ranks and its decoding follows the first file's channels: the
    split hashes each file's class name and bytes instead, so neither a new class folder sorting first nor a
    grayscale file sorting first moves the others."""
    ids = np.arange(60)
    common = {"val_fraction": 0.2, "test_fraction": 0.2, "classes": ["c0", "c1", "c2"]}
    base_dir = tmp_path / "base"
    base = memberships({**write_source(base_dir, "folder", ids), **common}, split_key=1234)
    new_class = tmp_path / "new_class"
    spec = write_source(new_class, "folder", ids)
    write_image(new_class / "folder" / "a_new" / "00000.png", np.zeros((4, 4, 3), np.uint8))  # sorts first
    assert moved(base, memberships({**spec, **common}, split_key=1234)) == 0
    gray = tmp_path / "gray"
    spec = write_source(gray, "folder", ids)
    first = gray / "folder" / "c0" / "00000.png"
    write_image(first.with_name("0.png"), coded_images(np.array([9999]), np.array([0]))[0][..., None])
    after = memberships({**spec, **common, "channels": 3}, split_key=1234)
    assert moved(base, after) == 0 and 9999 in after


def test_with_data_channels_a_grayscale_first_image_changes_no_other_images_pixels(tmp_path):
    """Every file used to be decoded at the first file's channel count, data.channels converting afterwards:
    one grayscale image sorting first turned every colour image grey."""
    rng = np.random.default_rng(0)
    colours = {i: rng.integers(0, 256, (4, 4, 3), dtype=np.uint8) for i in range(12)}

    def train_images(with_gray: bool):
        root = tmp_path / ("gray" if with_gray else "base")
        for i, image in colours.items():
            write_image(root / f"c{i % 2}" / f"{i + 1:03d}.png", image)
        if with_gray:
            write_image(root / "c0" / "000.png", np.full((4, 4, 1), 77, np.uint8))
        data = load_dataset({"source": "folder", "path": str(root), "classes": ["c0", "c1"], "channels": 3,
                             "val_fraction": 0.2, "test_fraction": 0.2}, split_key=1)
        return {image.tobytes() for image in data.x_train}

    base, with_gray = train_images(False), train_images(True)
    assert len(base) >= 6 and base <= with_gray  # every colour image the same, the gray one added or held out


def test_an_image_trees_class_set_channels_and_class_numbers_are_caveats_unless_given(tmp_path):
    spec = {**write_source(tmp_path, "folder", np.arange(30)), "val_fraction": 0.2, "test_fraction": 0.2}
    caveats = " ".join(load_dataset(spec, split_key=1).privacy_caveats())
    assert "number of classes (3) was read off" in caveats and "channel count" in caveats
    assert "data.classes names classes by number" in " ".join(
        load_dataset({**spec, "classes": [0, 1, 2]}, split_key=1).privacy_caveats())
    assert load_dataset({**spec, "classes": ["c0", "c1", "c2"], "channels": 3}, split_key=1).privacy_caveats() == []


def test_the_positions_split_is_what_moved_hundreds_and_stays_available_for_pinned_results(tmp_path):
    """The finding (issue 60): one example added to 5,000 moved hundreds of validation examples."""
    ids = np.arange(2000)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    spec_a = {**write_source(tmp_path / "a", "npz", ids), "split": "positions"}
    spec_b = {**write_source(tmp_path / "b", "npz", np.append(ids, 9999)), "split": "positions"}
    assert moved(memberships(spec_a), memberships(spec_b)) > 100
    caveats = load_dataset(spec_a).privacy_caveats()
    assert any("data.split: positions" in c for c in caveats)


def test_the_split_key_decides_the_split_and_a_known_key_is_a_caveat(tmp_path):
    spec = write_source(tmp_path, "npz", np.arange(N))
    secret = load_dataset(spec, split_key=5)
    assert not any("key is known" in c for c in secret.privacy_caveats())
    assert memberships(spec, split_key=5) == memberships(spec, split_key=5)
    assert memberships(spec, split_key=5) != memberships(spec, split_key=6)
    given = load_dataset({**spec, "split_seed": 3})
    assert any("data.split_seed" in c for c in given.privacy_caveats())
    assert memberships({**spec, "split_seed": 3}) == memberships({**spec, "split_seed": 3}, split_key=5)
    derived = load_dataset(spec, seed=2)  # no key given: derived from the public data seed
    assert any("key is known" in c for c in derived.privacy_caveats())
    sizes = [len(load_dataset(spec, split_key=k).y_val) for k in range(20)]
    expected = N * (1 - 0.2) * 0.1  # the test carve first (default 0.2), then 10% validation
    assert abs(np.mean(sizes) - expected) < 4 * np.sqrt(expected / 20)  # binomial sizes, f n on average


def test_a_limit_keeps_the_smallest_hashes_so_one_example_more_displaces_at_most_one(tmp_path):
    ids = np.arange(N)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    limit = {"limit_train": 200, "val_fraction": 0.0}
    before = memberships({**write_source(tmp_path / "a", "npz", ids), **limit}, split_key=9)
    after = memberships({**write_source(tmp_path / "b", "npz", np.append(ids, 31337)), **limit}, split_key=9)
    kept_before = {i for i, s in before.items() if s == "train"}
    kept_after = {i for i, s in after.items() if s == "train"}
    assert len(kept_before) == len(kept_after) == 200
    assert len(kept_before - kept_after) <= 1 and kept_after - kept_before <= {31337}
    caveats = load_dataset({**write_source(tmp_path / "a", "npz", ids), **limit}, split_key=9).privacy_caveats()
    assert any("data.limit_train=200" in c and "replace-one" in c for c in caveats)
    exactly = {"limit_train": N, "val_fraction": 0.0}  # nothing cut, but one example more would displace one
    caveats = load_dataset({**write_source(tmp_path / "a", "npz", ids), **exactly}, split_key=9).privacy_caveats()
    assert any(f"data.limit_train={N}" in c for c in caveats)


@pytest.mark.parametrize("spec, message", [
    ({"split": "random"}, "data.split: unknown split 'random'"),
    ({"split_seed": -1}, "data.split_seed: expected null or an integer"),
    ({"split_seed": 1.5}, "data.split_seed: expected null or an integer"),
])
def test_split_mistakes_are_one_line(spec, message):
    from sparta_tf.data import DataError

    with pytest.raises(DataError, match=message) as error:
        load_dataset({"source": "digits", **spec})
    assert "\n" not in str(error.value)


def test_positions_reproduce_the_splits_of_earlier_versions():
    """Pinned benchmarks keep their committed splits: ``split: positions`` is the stratified permutation."""
    from sparta_tf import random_streams
    from sparta_tf.data.splits import fraction_count, stratified_take

    data = load_dataset({"source": "digits", "split": "positions", "classes": [0, 1, 2], "val_fraction": 0.1},
                        seed=3)
    raw = loader.SOURCES["digits"](loader.parse_spec({"source": "digits"}), 3)
    labels = raw.train.labels[raw.train.labels < 3]
    test, rest = stratified_take(labels, fraction_count(len(labels), 0.2), random_streams.numpy_rng(3, "test_split"))
    val, train = stratified_take(labels[rest], fraction_count(len(rest), 0.1), random_streams.numpy_rng(3, "val_split"))
    assert (len(data.y_test), len(data.y_val), len(data.y_train)) == (len(test), len(val), len(train))
    assert np.array_equal(data.y_val, labels[rest][val]) and np.array_equal(data.y_test, labels[test])


def test_a_run_keeps_its_secret_split_key_and_a_run_started_before_stable_splits_resumes_by_positions(tmp_path):
    from trainers import split_key
    from trainers.config import ConfigError, validate
    from trainers.run_dir import RunDirectory
    from small_configs import tiny_config

    secret = validate(tiny_config(tmp_path / "a", seed=None))
    first = split_key.run_split_key(str(tmp_path), secret)
    assert split_key.run_split_key(str(tmp_path), secret) == first  # read back, never drawn again
    assert split_key.stored_split_key(str(tmp_path), secret) == first
    seeded = validate(tiny_config(tmp_path / "b", seed=4))
    assert split_key.run_split_key(str(tmp_path / "none"), seeded) == loader.derived_split_key(4)
    assert not (tmp_path / "none").exists()  # a seeded config's key is its seed's: nothing to keep
    with pytest.raises(ConfigError, match="data_split.json is missing"):
        split_key.stored_split_key(str(tmp_path / "elsewhere"), secret)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "journal.json").write_text("{}")  # a killed run's state ...
    (tmp_path / split_key.SPLIT_KEY).unlink()  # ... whose key is lost: a new one would move examples
    with pytest.raises(ConfigError, match=r"data_split.json is missing, but a killed run's state is there.*put the file back"):
        split_key.run_split_key(str(tmp_path), secret)
    assert not (tmp_path / split_key.SPLIT_KEY).exists()

    old = tmp_path / "old"  # a killed run recorded by a version before stable splits (no data.split)
    (old / "checkpoints").mkdir(parents=True)
    (old / "checkpoints" / "journal.json").write_text("{}")
    recorded = validate(tiny_config(old))
    del recorded["data"]["split"]
    (old / "config.json").write_text(__import__("json").dumps(recorded))
    with pytest.raises(ConfigError, match="it split its data by positions: set data.split: positions"):
        RunDirectory(str(old), validate(tiny_config(old)), resume=True)._check_state()
    pinned = validate(tiny_config(old))
    pinned["data"]["split"] = "positions"
    RunDirectory(str(old), pinned, resume=True)._check_state()
