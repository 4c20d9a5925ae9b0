"""User ids in the data (``data.user_key``), for user-level DP.

* npz arrays, folders (``<class>/<user>/<image>``) and TFDS features carry each example's user;
* a user's examples are held out together: no user is in two of training, validation and test;
* adding or removing one user (1, 5 or 50 examples) changes the membership of that user's examples
  only (the neighbouring relation of user-level DP), reordering changes nothing;
* what would cut users apart (positions splits, limits) and bad ids are refused in one line.
"""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from sparta_tf.data import DataError, load_dataset
from test_data import coded_images, decode_ids, write_image

USERS = 60


def _user_sizes(users: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 12, users)


def _write_npz(path, user_of: np.ndarray, test_users: np.ndarray | None = None):
    """An npz whose example ``i`` (its image encodes ``i``) belongs to user ``user_of[i]``."""
    ids = np.arange(len(user_of))
    arrays = {"x_train": coded_images(ids, ids % 3), "y_train": (ids % 3).astype(np.uint8),
              "patient_train": np.array([f"p{u}" for u in user_of])}
    if test_users is not None:
        test_ids = np.arange(len(test_users)) + 5000
        arrays.update(x_test=coded_images(test_ids, test_ids % 3), y_test=(test_ids % 3).astype(np.uint8),
                      patient_test=test_users)
    np.savez(path, **arrays)
    return {"source": "npz", "path": str(path), "user_key": "patient", "val_fraction": 0.2, "test_fraction": 0.2}


def _membership(spec: dict) -> dict:
    """Example id -> (split, user)."""
    data = load_dataset(spec, split_key=99)
    out = {}
    for split, x, users in (("train", data.x_train, data.users_train), ("val", data.x_val, data.users_val),
                            ("test", data.x_test, data.users_test)):
        out.update({int(i): (split, u) for i, u in zip(decode_ids(x), users)})
    return out


def test_a_users_examples_are_held_out_together_and_carry_their_id(tmp_path):
    user_of = np.repeat(np.arange(USERS), _user_sizes(USERS))
    members = _membership(_write_npz(tmp_path / "d.npz", user_of))
    assert len(members) == len(user_of)
    split_of_user: dict = {}
    for example, (split, user) in members.items():
        assert user == f"p{user_of[example]}"
        split_of_user.setdefault(user, set()).add(split)
    assert all(len(splits) == 1 for splits in split_of_user.values())
    assert {s for splits in split_of_user.values() for s in splits} == {"train", "val", "test"}
    data = load_dataset(_write_npz(tmp_path / "e.npz", user_of), split_key=99)
    assert data.user_count == len(np.unique(data.users_train))


@pytest.mark.parametrize("size", [1, 5, 50])
def test_one_user_more_or_less_moves_only_that_users_examples(tmp_path, size):
    user_of = np.repeat(np.arange(USERS), _user_sizes(USERS))
    base = _membership(_write_npz(tmp_path / "base.npz", user_of))
    added = _membership(_write_npz(tmp_path / "added.npz", np.append(user_of, [USERS] * size)))
    new = set(range(len(user_of), len(user_of) + size))
    assert set(added) - set(base) == new and len({added[i][0] for i in new}) == 1
    assert all(added[i] == base[i] for i in base)


def test_removing_a_user_leaves_every_other_users_split(tmp_path):
    user_of = np.repeat(np.arange(USERS), _user_sizes(USERS))
    base = load_dataset(_write_npz(tmp_path / "base.npz", user_of), split_key=99)
    gone = f"p{user_of[len(user_of) // 2]}"
    removed = load_dataset(_write_npz(tmp_path / "removed.npz", user_of[user_of != int(gone[1:])]), split_key=99)

    def split_of(data):
        return {u: s for s, users in (("train", data.users_train), ("val", data.users_val),
                                      ("test", data.users_test)) for u in users}

    before, after = split_of(base), split_of(removed)
    assert gone in before and gone not in after
    assert all(after[u] == before[u] for u in after)


def test_an_npz_test_split_carries_its_users(tmp_path):
    user_of = np.repeat(np.arange(20), 3)
    spec = _write_npz(tmp_path / "d.npz", user_of, test_users=np.arange(12) % 4)
    spec.pop("test_fraction")
    data = load_dataset(spec, split_key=1)
    assert sorted(set(data.users_test)) == ["0", "1", "2", "3"] and len(data.users_test) == 12


def test_a_folder_per_user_under_each_class(tmp_path):
    root = tmp_path / "scans"
    for label, name in enumerate(["benign", "malignant"]):
        for user in ("ann", "bob", "cy", "dee", "eve", "fay"):
            for i in range(2 + label):
                write_image(root / name / user / f"{i}.png", np.full((4, 4, 3), 40 * label, np.uint8))
    data = load_dataset({"source": "folder", "path": str(root), "user_key": "folder", "val_fraction": 0.0,
                         "test_fraction": 0.5}, split_key=5)
    users = np.concatenate([data.users_train, data.users_test])
    assert sorted(set(users)) == ["ann", "bob", "cy", "dee", "eve", "fay"] and len(users) == 6 * 2 + 6 * 3
    assert not set(data.users_train) & set(data.users_test)  # a user's scans in both classes stay together


def test_images_outside_a_user_folder_are_refused(tmp_path):
    root = tmp_path / "scans"
    write_image(root / "a" / "u1" / "0.png", np.zeros((4, 4, 3), np.uint8))
    write_image(root / "b" / "1.png", np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(DataError, match=r"^data\.user_key: .* outside a user sub-folder[^\n]*$"):
        load_dataset({"source": "folder", "path": str(root), "user_key": "folder"})


class SpartaTinyPatients(tfds.core.GeneratorBasedBuilder):
    """A 2-class builder whose examples carry a text ``patient`` feature (prepared locally)."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(4, 4, 1)),
                "label": tfds.features.ClassLabel(names=["a", "b"]),
                "patient": tfds.features.Text(),
            }),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(30)}

    def _generate_examples(self, count):
        for i in range(count):
            yield i, {"image": np.full((4, 4, 1), i, np.uint8), "label": i % 2, "patient": f"patient-{i // 3}"}


def test_a_tfds_feature_holds_the_users(tmp_path):
    spec = {"source": "tfds", "name": "sparta_tiny_patients", "data_dir": str(tmp_path), "user_key": "patient",
            "val_fraction": 0.2}
    load_dataset({**spec, "download": True})
    data = load_dataset(spec, split_key=3)
    users = np.concatenate([data.users_train, data.users_val, data.users_test])
    assert sorted(set(users)) == sorted(f"patient-{i}" for i in range(10)) and len(users) == 30
    assert not set(data.users_train) & (set(data.users_val) | set(data.users_test))
    with pytest.raises(DataError, match=r"^data\.user_key: TFDS data set .* has no feature 'person'"):
        load_dataset({**spec, "user_key": "person"})


@pytest.mark.parametrize("extra, key", [
    ({"split": "positions"}, "split"),
    ({"limit_train": 10}, "limit_train"),
    ({"limit_test": 10}, "limit_test"),
])
def test_what_would_cut_users_apart_is_refused(tmp_path, extra, key):
    spec = _write_npz(tmp_path / "d.npz", np.repeat(np.arange(10), 3))
    with pytest.raises(DataError, match=rf"^data\.{key}: [^\n]*$"):
        load_dataset({**spec, **extra})


@pytest.mark.parametrize("users, message", [
    (np.array([np.nan] + [1.0] * 29), "NaN or infinite user ids"),
    (np.array([""] + ["a"] * 29), "empty user ids"),
    (np.arange(29), "29 user ids for 30 images"),
])
def test_bad_user_ids_are_one_line(tmp_path, users, message):
    np.savez(tmp_path / "d.npz", x_train=coded_images(np.arange(30), np.arange(30) % 3), y_train=np.arange(30) % 3,
             patient_train=users)
    with pytest.raises(DataError, match=message) as error:
        load_dataset({"source": "npz", "path": str(tmp_path / "d.npz"), "user_key": "patient"})
    assert "\n" not in str(error.value)


def test_a_missing_user_array_and_a_folder_key_other_than_folder_are_refused(tmp_path):
    np.savez(tmp_path / "d.npz", x_train=coded_images(np.arange(30), np.arange(30) % 3), y_train=np.arange(30) % 3)
    with pytest.raises(DataError, match=r"^data\.user_key: .* has no 'patient_train' array"):
        load_dataset({"source": "npz", "path": str(tmp_path / "d.npz"), "user_key": "patient"})
    with pytest.raises(DataError, match=r"^data\.user_key: source 'folder' reads users from sub-folders"):
        load_dataset({"source": "folder", "path": str(tmp_path), "user_key": "patient"})
