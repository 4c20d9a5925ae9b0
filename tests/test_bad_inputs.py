"""Every bad input is a one-line error naming the problem and the fix, and the dry run fails exactly
when the run would. Each case goes through ``sparta-train`` (in process) twice: ``--dry-run`` and a real
run, which must both exit with the same status and the same message, and the run must leave no results,
no export and no checkpoint behind."""

import copy
import gzip
import io
import os
import pathlib
import tarfile

import numpy as np
import pytest
import yaml

from small_configs import set_key
from sparta_tf.backend import keras_version
from trainers import cli

BASE = {
    "data": {"source": "digits", "classes": [0, 1, 2], "val_fraction": 0.1},
    "model": {"name": "cifar_resnet_gn", "depth": 8, "width": 4},
    "method": {"name": "sparta", "density": 0.25, "warmup_epochs": 1},
    "privacy": {"target_epsilon": 8.0, "delta": 1e-4},
    "training": {"epochs": 3, "batch_size": 64, "learning_rate": 0.05, "seed": 0},
}


def _npz(tmp, name, **arrays):
    path = tmp / f"{name}.npz"
    np.savez(path, **arrays)
    return str(path)


def _images(n, labels):
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, size=(n, 8, 8), dtype=np.uint8), np.asarray(labels, np.int64)


def _stray_label(tmp):
    x, y = _images(60, np.arange(60) % 3)
    y[5] = 255
    return _npz(tmp, "stray", x_train=x, y_train=y)


def _huge_label(tmp):
    x, y = _images(60, np.arange(60) % 3)
    y[0] = 10_000_000
    return _npz(tmp, "huge", x_train=x, y_train=y)


def _one_class(tmp):
    return _npz(tmp, "one", **dict(zip(("x_train", "y_train"), _images(60, np.zeros(60)))))


def _empty(tmp):
    return _npz(tmp, "empty", x_train=np.zeros((0, 8, 8), np.uint8), y_train=np.zeros(0, np.int64))


def _garbage(tmp, name="garbage.npz"):
    path = tmp / name
    path.write_bytes(b"\x00not a zip file at all" * 10)
    return str(path)


def _absolute_tar(tmp):
    path = tmp / "abs.tar.gz"
    payload = b"GIF89a"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("/tmp/evil/a/0.png")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return str(path)


def _garbage_tar(tmp):
    path = tmp / "broken.tar.gz"
    path.write_bytes(gzip.compress(b"this is not a tar archive") [:-8])
    return str(path)


def _a_file(tmp):
    path = tmp / "occupied"
    path.write_text("x")
    return str(path)


def _garbage_keras(tmp):
    path = tmp / "model.keras"
    path.write_bytes(b"PK\x03\x04 broken zip")
    return str(path)


def _rgb_keras(tmp):
    """A saved model that takes 3-channel images (the private digits have 1)."""
    import tensorflow as tf

    inputs = tf.keras.Input((8, 8, 3))
    outputs = tf.keras.layers.Dense(3)(tf.keras.layers.GlobalAveragePooling2D()(
        tf.keras.layers.Conv2D(4, 3, padding="same")(inputs)))
    path = tmp / "rgb.keras"
    tf.keras.Model(inputs, outputs).save(path)
    return str(path)


# (id, changes {dotted key: value or a callable(tmp) -> value}, expected status, message fragment)
CASES = [
    # privacy
    ("eps-negative", {"privacy.target_epsilon": -1}, 2, "privacy.target_epsilon=-1 must be > 0"),
    ("eps-zero", {"privacy.target_epsilon": 0}, 2, "privacy.target_epsilon=0 must be > 0"),
    ("eps-text", {"privacy.target_epsilon": "high"}, 2, "privacy.target_epsilon='high' must be"),
    ("eps-list", {"privacy.target_epsilon": [1, 2]}, 2, "must be an integer or a number"),
    ("eps-inf", {"privacy.target_epsilon": float("inf")}, 2, "must be a finite number"),
    ("eps-meaningless", {"privacy.target_epsilon": 1e6}, 2, "is met even by noise_multiplier"),
    ("delta-zero", {"privacy.delta": 0}, 2, "privacy.delta=0 must be in (0, 1)"),
    ("delta-one", {"privacy.delta": 1}, 2, "privacy.delta=1 must be in (0, 1)"),
    ("delta-too-large-for-n", {"privacy.delta": 0.01}, 2, "privacy.delta=0.01 must be < 1/n"),
    ("delta-nan", {"privacy.delta": float("nan")}, 2, "must be a finite number"),
    ("delta-below-pld", {"privacy.delta": 1e-30}, 2, "is below 1e-15, the smallest delta the PLD accountant"),
    ("clip-zero", {"privacy.clip_norm": 0}, 2, "privacy.clip_norm=0 must be > 0"),
    ("clip-inf", {"privacy.clip_norm": float("inf")}, 2, "privacy.clip_norm=inf must be a finite number"),
    ("clip-nan", {"privacy.clip_norm": float("nan")}, 2, "must be a finite number"),
    ("sigma-negative", {"privacy.noise_multiplier": -1}, 2, "privacy.noise_multiplier=-1 must be >= 0"),
    ("sigma-zero", {"privacy.noise_multiplier": 0}, 2, "privacy.noise_multiplier=0 gives no privacy"),
    ("sigma-too-small", {"privacy.noise_multiplier": 0.1}, 2, "more than privacy.target_epsilon=8"),
    ("sigma-too-small-rdp", {"privacy.noise_multiplier": 0.1, "privacy.accountant": "rdp"}, 2,
     "more than privacy.target_epsilon=8"),
    ("sigma-a-little-small", {"privacy.noise_multiplier": 0.65}, 2,  # past the one-step bound: the plan's epsilon
     "privacy.noise_multiplier=0.65 spends epsilon="),
    ("accountant", {"privacy.accountant": "gdp"}, 2, "privacy.accountant='gdp' must be one of pld, rdp"),
    ("sampling", {"privacy.sampling": "fixed"}, 2, "privacy.sampling='fixed' must be one of"),
    ("bands-shuffle", {"privacy.sampling": "shuffle", "privacy.bands": 2}, 2,
     "privacy.sampling: shuffle with privacy.bands=2: correlated noise needs cyclic Poisson sampling; set sampling"),
    ("privacy-unknown-key", {"privacy.epsilon": 2}, 2, "unknown key privacy.epsilon"),
    ("privacy-not-mapping", {"privacy": [1]}, 2, "privacy must be a mapping"),
    # training
    ("epochs-zero", {"training.epochs": 0}, 2, "training.epochs=0 must be >= 1"),
    ("epochs-float", {"training.epochs": 2.5}, 2, "training.epochs=2.5 must be an integer"),
    ("epochs-text", {"training.epochs": "ten"}, 2, "training.epochs='ten' must be an integer"),
    ("batch-zero", {"training.batch_size": 0}, 2, "training.batch_size=0 must be a number > 0"),
    ("batch-larger-than-n", {"training.batch_size": 100000}, 2, "is larger than the training set"),
    ("physical-zero", {"training.physical_batch_size": 0}, 2, "training.physical_batch_size=0 must be >= 1"),
    ("optimizer", {"training.optimizer": "rmsprop"}, 2, "training.optimizer='rmsprop' must be one of"),
    ("momentum-one", {"training.momentum": 1.0}, 2, "training.momentum=1.0 must be in [0, 1)"),
    ("lr-zero", {"training.learning_rate": 0}, 2, "training.learning_rate=0 must be > 0"),
    ("lr-inf", {"training.learning_rate": float("inf")}, 2, "must be a finite number"),
    ("lr-nan", {"training.learning_rate": float("nan")}, 2, "must be a finite number"),
    ("head-lr-negative", {"training.head_learning_rate": -1}, 2, "training.head_learning_rate=-1 must be > 0"),
    ("schedule", {"training.schedule": "linear"}, 2, "training.schedule='linear' must be one of"),
    ("warmup-fraction", {"training.warmup_fraction": 1.0}, 2, "training.warmup_fraction=1.0 must be in [0, 1)"),
    ("weight-decay", {"training.weight_decay": -0.1}, 2, "training.weight_decay=-0.1 must be >= 0"),
    ("seed-text", {"training.seed": "abc"}, 2, "training.seed='abc' must be"),
    ("seed-2**32", {"training.seed": 2**32}, 2, "training.seed=4294967296 must be in [0, 4294967295]"),
    ("seed-negative", {"training.seed": -1}, 2, "training.seed=-1 must be in [0, 4294967295]"),
    ("random-mask-seed-negative", {"method": {"name": "random", "seed": -1}}, 2, "method.seed=-1 must be in [0, 2**63)"),
    ("jit", {"training.jit_compile": "yes"}, 2, "training.jit_compile='yes' must be true, false or auto"),
    ("engine", {"training.engine": "fast"}, 2, "training.engine='fast' must be one of"),
    ("training-unknown-key", {"training.lr": 0.1}, 2, "unknown key training.lr"),
    # method
    ("method-unknown", {"method.name": "lora"}, 2, "method.name='lora' must be one of"),
    ("density-high", {"method.density": 1.5}, 2, "method.density=1.5 must be in [0, 1]"),
    ("density-negative", {"method.density": -0.1}, 2, "method.density=-0.1 must be in [0, 1]"),
    ("warmup-negative", {"method.warmup_epochs": -1}, 2, "method.warmup_epochs=-1 must be >= 0"),
    ("warmup-too-long", {"method.warmup_epochs": 2}, 2, "method.warmup_epochs=2 must be < training.epochs - 1"),
    ("score-unknown", {"method.score": "max"}, 2, "method.score='max' is not a score of sparta"),
    ("granularity", {"method.granularity": "column"}, 2, "method.granularity='column' must be one of row, entry"),
    ("density-overrides", {"method.density_overrides": {"conv*": 2}}, 2, "every density must be a number in"),
    ("density-overrides-no-layer", {"method.density_overrides": {"dense_*": 0.5}}, 2,
     "method.density_overrides pattern 'dense_*' matches no maskable layer"),
    ("density-zero", {"method.density": 0}, 2, "method.density=0 keeps no kernel row or entry: method sparta would "
     "train only the biases, norms and head after its selection epoch has spent epsilon; use method.name=bitfit"),
    ("density-zero-mp", {"method": {"name": "mp", "density": 0}}, 2, "method.density=0 keeps no kernel row or entry"),
    ("x-bitfit-no-bias-phase", {"method": {"name": "x_bitfit", "full_epochs": 3}}, 2,
     "method.full_epochs=3 must be < training.epochs"),
    ("frost-r-eps", {"method": {"name": "dp_frost", "r_eps": 1.0}}, 2, "method.r_eps=1.0 must be in (0, 1)"),
    ("frost-alpha", {"method": {"name": "dp_frost", "frost_alpha": 3}}, 2, "method.frost_alpha=3 must be one of"),
    ("frost-gamma", {"method": {"name": "dp_frost", "gamma": 0}}, 2, "method.gamma=0 must be in (0, 1]"),
    ("ssgd-prune", {"method": {"name": "dp_ssgd", "prune": "magnitude"}}, 2, "method.prune='magnitude' must be"),
    ("ssgd-prune-rate", {"method": {"name": "dp_ssgd", "prune_rate": 1.0}}, 2, "method.prune_rate=1.0 must be in"),
    ("ssgd-drop-mode", {"method": {"name": "dp_ssgd", "drop_mode": "topk"}}, 2, "method.drop_mode='topk' must be"),
    ("ssgd-snip-sigma", {"method": {"name": "dp_ssgd", "snip_noise_multiplier": 0}}, 2,
     "method.snip_noise_multiplier=0 must be > 0"),
    ("method-unknown-key", {"method.alpha": 1}, 2, "unknown key method.alpha"),
    ("mask-missing", {"method.mask": "/nonexistent/mask"}, 2, "no mask at /nonexistent/mask"),
    ("mask-garbage", {"method.mask": lambda t: _garbage(t, "mask.npz")}, 2, "is not a mask saved by sparta-tf"),
    # model
    ("model-unknown", {"model": {"name": "resnet50"}}, 2, "model.name='resnet50' is unknown"),
    ("model-missing-name", {"model": {"depth": 8}}, 2, "model.name is required"),
    ("model-bad-depth", {"model.depth": 7}, 2, "CIFAR ResNet depth must be 6n+2"),
    ("model-depth-text", {"model.depth": "deep"}, 2, "CIFAR ResNet depth must be 6n+2"),
    ("model-groups", {"model.groups": 3}, 2, "GroupNormalization with 3 groups does not divide"),
    ("model-groups-zero", {"model.groups": 0}, 2, "groups=0 must be an integer >= 1"),
    ("model-width-zero", {"model.width": 0}, 2, "width=0 must be an integer >= 1"),
    ("model-shortcut", {"model.shortcut": "C"}, 2, "shortcut must be 'A' or 'B'"),
    ("model-key-twice", {"model.args": {"depth": 14}}, 2, "model.depth is given both at the top level"),
    ("model-unknown-key", {"model.heads": 2}, 2, "model.heads is not a valid key"),
    ("model-num-classes", {"model.num_classes": 3}, 2, "model.num_classes is not allowed"),
    ("resnet20-depth", {"model": {"name": "resnet20_gn", "depth": 32}}, 2, "model.depth is not a valid key"),
    ("vit-heads", {"model": {"name": "vit_tiny", "dim": 64, "heads": 3}}, 2, "dim=64 is not divisible by heads=3"),
    ("vit-patch", {"model": {"name": "vit_tiny", "patch_size": 0}}, 2, "patch_size=0 must be an integer >= 1"),
    ("vit-patch-size-vs-image", {"model": {"name": "vit_tiny", "patch_size": 3, "dim": 12, "depth": 1,
                                           "heads": 2, "mlp_dim": 8}}, 2, "is not a multiple of patch_size=3"),
    ("wrn-depth", {"model": {"name": "wrn_gn", "depth": 11}}, 2, "WRN depth must be 6n+4"),
    ("wrn-dropout", {"model": {"name": "wrn_gn", "dropout_rate": 1.5}}, 2, "dropout_rate must be in [0, 1)"),
    ("saved-no-path", {"model": {"name": "saved"}}, 2, "model.path is required"),
    ("saved-missing", {"model": {"name": "saved", "path": "/nonexistent.keras"}}, 2, "does not exist"),
    ("saved-garbage", {"model": {"name": "saved", "path": _garbage_keras}}, 2, "cannot load a Keras model"),
    ("keras-cv-backbone", {"model": {"name": "keras_cv", "backbone": "ResNet1000"}}, 2,
     "model.backbone='ResNet1000' is not a keras-cv backbone" if keras_version().startswith("2.15")
     else "model.name=keras_cv needs keras-cv 0.9 on Keras 2.15"),  # the TF 2.21 line has no keras-cv
    # data
    ("data-source", {"data": {"source": "csv"}}, 1, "data.source"),
    ("data-missing-source", {"data": {"classes": [0, 1]}}, 2, "data.source is required"),
    ("data-unknown-key", {"data.colour": True}, 1, "data.colour"),
    ("data-class-range", {"data.classes": [0, 42]}, 1, "data.classes: class id 42 is out of range"),
    ("data-class-name", {"data.classes": [0, "cat"]}, 1, "unknown class name 'cat'"),
    ("data-class-twice", {"data.classes": [1, 1]}, 1, "data.classes: has duplicate entries [1, 1]"),
    ("data-one-class", {"data.classes": [3]}, 1, "a classifier needs at least 2 classes"),
    ("data-val-fraction", {"data.val_fraction": 1.5}, 1, "data.val_fraction"),
    ("data-limit-zero", {"data.limit_train": 0}, 1, "data.limit_train"),
    ("data-normalize", {"data.normalize": "minmax"}, 1, "data.normalize"),
    ("data-mean-without-std", {"data.normalize": "standard", "data.mean": [0.5]}, 1, "data.std: missing"),
    ("npz-missing", {"data": {"source": "npz", "path": "/nonexistent.npz"}}, 1, "data.path: no such file"),
    ("npz-garbage", {"data": {"source": "npz", "path": _garbage}}, 1, "cannot read"),
    ("npz-empty", {"data": {"source": "npz", "path": _empty}}, 1, "has 0 training examples"),
    ("npz-stray-label", {"data": {"source": "npz", "path": _stray_label}}, 1, "have no training examples"),
    ("npz-huge-label", {"data": {"source": "npz", "path": _huge_label}}, 1, "more than 100,000 classes"),
    ("npz-one-class", {"data": {"source": "npz", "path": _one_class}}, 1, "at least 2 classes"),
    ("tar-absolute-member", {"data": {"source": "tar", "path": _absolute_tar}}, 1,
     "has an absolute path or '..'"),
    ("tar-garbage", {"data": {"source": "tar", "path": _garbage_tar}}, 1, "cannot extract"),
    ("synthetic-huge-images", {"data": {"source": "synthetic", "num_examples": 60, "num_classes": 3,
                                        "image_size": [100000, 100000]}}, 1,
     "data.image_size: [100000, 100000] for 60 synthetic images of 3 channel(s) needs"),
    ("resize-huge", {"data.image_size": [100000, 100000]}, 1, "data.image_size: [100000, 100000] for"),
    ("tfds-offline", {"data": {"source": "tfds", "name": "mnist", "download": True, "data_dir": "TMP"}}, 1,
     "is unreachable (offline)"),
    ("tfds-not-prepared", {"data": {"source": "tfds", "name": "mnist", "data_dir": "TMP"}}, 1,
     "data.download"),
    # pre-training
    ("pretrain-no-data", {"pretrain.enabled": True}, 2, "pretrain.enabled is true but there is neither"),
    ("pretrain-data-key", {"pretrain": {"enabled": True, "data": {"source": "digits", "colour": 1}}}, 1,
     "pretrain.data.colour"),
    ("pretrain-data-source", {"pretrain": {"enabled": True, "data": {"source": "csv"}}}, 1, "pretrain.data"),
    ("pretrain-checkpoint-garbage", {"pretrain": {"enabled": True, "checkpoint": _garbage_keras,
                                                  "data": {"source": "digits", "classes": [5, 6, 7, 8, 9]}}}, 2,
     "pretrain.checkpoint"),
    ("pretrain-on-private-data", {"pretrain": {"enabled": True, "data": {"source": "digits", "classes": [2, 3]}}}, 2,
     "pretrain.data reads the private data's examples"),
    ("pretrain-on-private-data-by-other-names", {"pretrain": {"enabled": True, "data": {"source": "digits",
                                                                                    "classes": ["2", "3"]}}}, 2,
     "pretrain.data shares"),
    ("pretrain-on-private-data-loaded-otherwise", {"pretrain": {"enabled": True, "data": {
        "source": "digits", "classes": ["2", "3"], "normalize": "standard", "mean": [0.3], "std": [0.4],
        "image_size": [10, 10]}}}, 2, "pretrain.data shares"),  # the same images, scaled and resized otherwise
    ("pretrain-epochs", {"pretrain.epochs": 0}, 2, "pretrain.epochs=0 must be >= 1"),
    ("pretrain-channels", {"pretrain": {"enabled": True, "data": {"source": "digits", "classes": [5, 6, 7],
                                                                  "channels": 3}}}, 2,
     "pretrain.data has 3 channel(s) but the private data has 1; set pretrain.data.channels"),
    ("pretrain-data-unreadable", {"pretrain": {"enabled": True, "data": {"source": "npz", "path": _garbage}}}, 1,
     "pretrain.data"),
    ("pretrain-checkpoint-channels", {"pretrain": {"enabled": True, "checkpoint": _rgb_keras}}, 2,
     "the input of pretrain.checkpoint has 3 channel(s) but the private data has 1"),
    ("pretrain-optimizer", {"pretrain.optimizer": "lamb"}, 2, "pretrain.optimizer='lamb' must be one of"),
    # outputs
    ("output-dir-is-a-file", {"output_dir": _a_file}, 2, "is a file"),
    ("output-dir-under-a-file", {"output_dir": lambda t: os.path.join(_a_file(t), "run")}, 2,
     "cannot be created"),
    ("output-dir-list", {"output_dir": ["a"]}, 2, "output_dir=['a'] must be a string path"),
    ("output-dir-in-proc", {"output_dir": "/proc/sparta-run"}, 2,  # permission bits say yes, even to root
     "output_dir /proc/sparta-run cannot be created in /proc"),
    ("export-version", {"export.version": 0}, 2, "export.version=0 must be >= 1"),
    ("unknown-section", {"optimizer": {"lr": 1}}, 2, "unknown section 'optimizer'"),
]


def _resolve(value, tmp_path):
    """Callables become their value for this test's folder; "TMP" the folder itself."""
    if callable(value):
        return value(tmp_path)
    if isinstance(value, dict):
        return {k: _resolve(v, tmp_path) for k, v in value.items()}
    return str(tmp_path / "tfds") if value == "TMP" else value


def _config(tmp_path, changes):
    config = copy.deepcopy(BASE)
    config["output_dir"] = str(tmp_path / "run")
    for key, value in changes.items():
        set_key(config, key, _resolve(value, tmp_path))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def _main(args, capsys):
    status = cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return status, [line for line in err if not line.startswith("note:")]


def test_there_are_more_than_a_hundred_cases():
    assert len(CASES) >= 100 and len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("name, changes, status, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_the_dry_run_fails_like_the_run(tmp_path, capsys, name, changes, status,
                                                                  fragment):
    path, config = _config(tmp_path, changes)
    dry_status, dry = _main(["--config", str(path), "--dry-run"], capsys)
    run_status, run = _main(["--config", str(path)], capsys)
    assert (dry_status, run_status) == (status, status), (dry, run)
    assert len(run) == 1 and fragment in run[0], run
    assert dry == run
    out = pathlib.Path(config["output_dir"]) if isinstance(config.get("output_dir"), str) else None
    if out is not None and out.is_dir():
        assert not (out / "results.json").exists() and not (out / "export").exists()
        assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints")


def test_config_file_problems(tmp_path, capsys):
    cases = {
        "a-directory": (tmp_path, "is a directory"),
        "latin-1": (b"data: {source: digits}\nmodel: {name: caf\xe9}\n", "is not UTF-8 text"),
        "utf-16": ("data: {source: digits}\n".encode("utf-16"), "is not UTF-8 text"),
        "binary": (bytes(range(256)), "is not UTF-8 text"),
        "duplicate-key": (b"privacy:\n  target_epsilon: 4\n  target_epsilon: 400\n", "appears twice"),
        "duplicate-section": (b"data: {source: digits}\ndata: {source: npz}\n", "appears twice"),
        "python-tag": (b"data: !!python/object/apply:os.system ['true']\n", "is not valid YAML"),
        "syntax": (b"data: {source: digits\nmodel: [", "is not valid YAML at line"),
        "a-list": (b"- a\n- b\n", "must be a mapping of sections"),
        "missing": (None, "does not exist"),
    }
    for name, (content, fragment) in cases.items():
        if isinstance(content, bytes):
            path = tmp_path / f"{name}.yaml"
            path.write_bytes(content)
        else:
            path = content if content is not None else tmp_path / "missing.yaml"
        status, lines = _main(["--config", str(path)], capsys)
        assert status == 2 and len(lines) == 1 and fragment in lines[0], (name, lines)


@pytest.mark.parametrize("override, fragment", [
    ("privacy.target_epsilon=[1,", "is not valid YAML"),
    ("privacy.target_epsilon={a", "is not valid YAML"),
    ("output_dir=!!python/object/apply:os.getcwd []", "is not valid YAML"),
    ("privacy.target_epsilon=!!binary aGVsbG8=", "must be an integer or a number"),
    ("privacy.=1", "has an empty key"),
    ("privacy.target_epsilon", "must look like section.key=value"),
    ("output_dir.x=1", "output_dir is not a section"),
    ("privacy.clip_norm=inf", "must be a finite number"),
    ("privacy.clip_norm=.inf", "must be a finite number"),
    ("training.learning_rate=nan", "must be a finite number"),
    ("training.seed=4294967296", "training.seed=4294967296 must be in [0, 4294967295]"),
])
def test_bad_set_values(tmp_path, capsys, override, fragment):
    path, _ = _config(tmp_path, {})
    status, lines = _main(["--config", str(path), "--set", override], capsys)
    assert status == 2 and len(lines) == 1 and fragment in lines[0], lines


def test_a_mask_of_another_model_is_refused_before_training(tmp_path, capsys):
    import tensorflow as tf

    import sparta_tf as st
    from sparta_tf.masks import MaskProvenance

    other = st.models.cifar_resnet_gn(depth=14, width=4, input_shape=(8, 8, 1), num_classes=3)
    mask = [st.trainable.rows(g, [0]) for g in st.groups.row_groups(other)]
    st.masks.save_mask(str(tmp_path / "mask"), mask, other, provenance=MaskProvenance.public())
    tf.keras.backend.clear_session()
    path, _ = _config(tmp_path, {"method.mask": str(tmp_path / "mask")})
    for args in (["--dry-run"], []):
        status, lines = _main(["--config", str(path)] + args, capsys)
        assert status == 2 and "was selected for another model" in lines[0], lines


def test_a_hopeless_fixed_noise_multiplier_is_refused_in_seconds(tmp_path):
    """Regression: privacy.noise_multiplier=0.01 was refused only after the PLD accountant's minutes of
    work (a grid of millions of privacy-loss bins); one step's exact epsilon bounds the run's from below."""
    import subprocess
    import sys
    import time

    path, _ = _config(tmp_path, {"privacy.noise_multiplier": 0.01, "training.epochs": 15})
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "trainers", "--config", str(path), "--dry-run"], env=env,
                            capture_output=True, text=True, timeout=150)
    assert time.monotonic() - start < 120
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("note:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("config error: privacy.noise_multiplier=0.01 spends epsilon > ") and \
        "(one step alone, at delta=0.0001) over the planned run, more than privacy.target_epsilon=8" in lines[0]


@pytest.mark.parametrize("args, fragment", [
    (["--epsilon", "-1"], "argument --epsilon: -1 must be > 0"),
    (["--density", "2"], "argument --density: 2 must be in (0, 1]"),
    (["--method", "nosuch"], "argument --method: invalid choice: 'nosuch'"),
    (["--sample-rate", "0"], "argument --sample-rate: 0 must be in (0, 1]"),
    (["--epochs", "2"], "sparta-example: error: --epochs 2 is too few for --method sparta; give at least 3"),
])
def test_sparta_example_bad_arguments_are_one_line(capsys, args, fragment):
    from trainers import example as quickstart

    with pytest.raises(SystemExit) as stop:
        quickstart.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and fragment in err[-1] and not [line for line in err if "Traceback" in line], err


def test_sparta_example_offers_every_method_and_runs_dp_frost(capsys):
    """Regression: --help did not list dp_frost and dp_ssgd, and --method dp_frost ended in an
    AttributeError; the example runs a method as sparta-train does (plan, DP model, preparation, fit)."""
    from trainers import example as quickstart
    from sparta_tf.methods import METHODS

    assert sorted(quickstart.METHOD_NAMES) == sorted(METHODS)
    with pytest.raises(SystemExit):
        quickstart.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(name in help_text for name in METHODS), help_text
    quickstart.main(["--method", "dp_frost", "--epochs", "3", "--pretrain-epochs", "1", "--seed", "0"])
    out = capsys.readouterr().out
    assert "before training: frost_selection" in out and "phase frost_selection: 5 x" in out
    assert "== private test accuracy" in out
