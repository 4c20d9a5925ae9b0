"""The key of a run's stable data splits (:mod:`sparta_tf.data.membership`), and the splits of runs that
started before there were stable splits.

A config that keeps the stable splits (``data.split: hash``, the default) and fixes neither
``data.split_seed`` nor ``training.seed`` holds its examples out with a secret key: drawn from the OS
once per run and kept with the run's private state in ``output_dir/data_split.json`` (a resumed run
reads it back, so its splits never change), or once per tuning for all its candidates
(``tuning.json``). Otherwise the loader derives the key from the seed the config gives, and the data set
records that as a caveat (``data.split_seed``) or the run's seed caveat says so (``training.seed``).

A config recorded without ``data.split`` (a run or tuning started by a version before stable splits)
split by positions: :func:`recorded_data` reads it so, and such a run resumes only with
``data.split: positions``.
"""

from __future__ import annotations

import json
import os

from sparta_tf import checkpointing, random_streams
from sparta_tf.atomic_files import write_atomic
from sparta_tf.data.spec import DEFAULT_SPLIT, POSITIONS_SPLIT
from trainers.config import ConfigError

SPLIT_KEY = "data_split.json"


def _stable_without_split_seed(config: dict) -> bool:
    """Stable (hash) splits whose key ``data.split_seed`` does not give."""
    data = config["data"]
    return data.get("split", DEFAULT_SPLIT) == DEFAULT_SPLIT and data.get("split_seed") is None


def needs_secret_key(config: dict) -> bool:
    """Whether the run's splits take a secret key of their own (module doc)."""
    return _stable_without_split_seed(config) and config["training"]["seed"] is None


def seed_key(config: dict) -> int | None:
    """The key ``training.seed`` decides (stable splits, no ``data.split_seed``), covered by the run's seed
    caveat; None otherwise."""
    from sparta_tf.data.loader import derived_split_key

    seed = config["training"]["seed"]
    return derived_split_key(seed) if seed is not None and _stable_without_split_seed(config) else None


def new_key(config: dict) -> int | None:
    """A fresh secret key when :func:`needs_secret_key`, else :func:`seed_key` (what a dry run uses)."""
    return random_streams.new_seed() if needs_secret_key(config) else seed_key(config)


LOST_KEY = 0
"""What a run whose state is there but whose key file is gone proposes as its key (a drawn key is 0 with
probability 2^-63): the chief's proposal decides for every worker, so all refuse together."""


def run_split_key(output_dir: str, config: dict, share=None) -> int | None:
    """The run's split key: read from ``output_dir`` (a resumed run), else drawn and written there before
    the data is loaded; :func:`seed_key` when the config's seed decides the splits. ``share(key)``: the
    key every worker of a multi-worker run uses (the chief's, :func:`sparta_tf.distribute.shared_seed`),
    which each worker then keeps in its own ``output_dir``: workers that drew their own keys would hold
    out different examples and train on different arrays. A ConfigError when the run's key file is gone but a
    killed run's state is there (on several workers: the chief's)."""
    if not needs_secret_key(config):
        return seed_key(config)
    path = os.path.join(output_dir, SPLIT_KEY)
    stored = _read_key(path) if os.path.exists(path) else None
    lost = stored is None and checkpointing.has_state(output_dir) is not None
    key = LOST_KEY if lost else random_streams.new_seed() if stored is None else stored
    if share is not None:  # the chief's decides: every worker refuses when the chief lost its key
        key = share(key)
    if key == LOST_KEY:
        raise ConfigError(f"{path} is missing, but a killed run's state is there, and its data splits were drawn "
                          "with the secret key kept in that file: a new key would move examples between the training "
                          "and held-out splits; put the file back, or start a new output_dir")
    if key != stored:
        write_atomic(path, json.dumps({"key": key}))  # private: beside the checkpoints, never released
    return key


def stored_split_key(output_dir: str, config: dict) -> int | None:
    """The key a finished run in ``output_dir`` used (:func:`seed_key` when its config's seed decides the
    splits); a ConfigError when the run's key is missing."""
    if not needs_secret_key(config):
        return seed_key(config)
    path = os.path.join(output_dir, SPLIT_KEY)
    if not os.path.exists(path):
        raise ConfigError(f"{path} is missing: the run's data splits were drawn with a secret key kept there; "
                          "check the run's own output_dir")
    return _read_key(path)


def _read_key(path: str) -> int:
    with open(path) as f:
        return random_streams.check_seed(json.load(f)["key"])


def recorded_data(data: dict) -> dict:
    """A recorded ``data`` section as the run used it: without ``split``, by positions (module doc)."""
    return data if "split" in data else {**data, "split": POSITIONS_SPLIT}
