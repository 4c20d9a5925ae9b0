"""Non-private pre-training on public data for ``sparta-train``, and its cache.

The model DP fine-tuning starts from is loaded (``pretrain.checkpoint``, or ``output_dir/pretrained.keras``
made under this configuration's :func:`pretraining_key`) or pre-trained on ``pretrain.data`` (public
data, which :func:`trainers.run.preflight` checks shares no examples with the private data) and
cached with its key. Nothing here touches the private data but its channel count.
"""

from __future__ import annotations

import json
import os

import tensorflow as tf

from sparta_tf.atomic_files import replace_atomically, write_atomic
from sparta_tf.data.loader import image_digests
from trainers.config import ConfigError

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
"""The loss of pre-training and of DP fine-tuning (integer labels, logits)."""


def data_seed(config: dict) -> int:
    """The seed of the data streams and of pre-training: ``training.seed``, 0 when it is null (the DP
    noise and batches then take a secret seed of their own)."""
    seed = config["training"]["seed"]
    return 0 if seed is None else seed


PRETRAINED, PRETRAINED_KEY = "pretrained.keras", "pretrained.json"


def pretraining_key(config: dict) -> dict:
    """What a pre-trained model depends on: the model section, the pretrain section (but its checkpoint)
    and the seed; ``pretrained.json`` records it next to the cached ``pretrained.keras``."""
    spec = {k: v for k, v in config["pretrain"].items() if k != "checkpoint"}
    return json.loads(json.dumps({"model": config["model"], "pretrain": spec, "seed": data_seed(config)}))


def pretrained_source(config: dict, output_dir: str) -> tuple[str, str]:
    """Where the run's pre-trained model comes from: ``("checkpoint", path)`` (pretrain.checkpoint, when it
    exists), ``("cache", path)`` (``output_dir/pretrained.keras`` made under this config's
    :func:`pretraining_key`) or ``("data", path to write)``: pre-training on pretrain.data. A cache made
    under another configuration (or without a key) is never reused."""
    checkpoint = config["pretrain"]["checkpoint"]
    if checkpoint:
        return ("checkpoint" if os.path.exists(checkpoint) else "data"), checkpoint
    path = os.path.join(output_dir, PRETRAINED)
    if not os.path.exists(path):
        return "data", path
    try:
        with open(os.path.join(output_dir, PRETRAINED_KEY)) as f:
            key = json.load(f)
    except (OSError, ValueError):
        key = None
    return ("cache" if key == pretraining_key(config) else "stale"), path


def _check_channels(have: int, private, what: str, fix: str) -> None:
    channels = private.input_shape[-1]
    if have != channels:
        raise ConfigError(f"{what} has {have} channel(s) but the private data has {channels}; {fix}")


def _loaded_pretrained(source: str, path: str, private) -> tf.keras.Model:
    what = "pretrain.checkpoint" if source == "checkpoint" else f"the cached {path}"
    model = load_pretrained(path, what)
    _check_channels(model.input_shape[-1], private, f"the input of {what}",
                    "pre-train on data with the private data's channels")
    return model


def _public_data(config: dict, private):
    from sparta_tf.data import DataError, load_dataset

    try:
        public = load_dataset(config["pretrain"]["data"], seed=data_seed(config))
    except DataError as error:
        raise error.under("pretrain.data") from None
    _check_channels(public.input_shape[-1], private, "pretrain.data",
                    "set pretrain.data.channels (or data.channels) so that they agree")
    _check_disjoint(public, private)
    return public


def _check_disjoint(public, private) -> None:
    """ConfigError when the public training images include a private training or validation image, compared
    by their bytes as stored (before scaling, channel conversion, resizing and normalisation, which each data
    section sets on its own: :attr:`~sparta_tf.data.Dataset.stored_image_digests`) and as loaded: the
    non-private pre-training would train on it. The configs' check (``may_share_examples``, before anything
    loads) compares what the sections say; this one, what they load (another spelling of the classes,
    another path to the same files, another normalisation of them)."""
    shared = len(image_digests(public.x_train) & (image_digests(private.x_train) | image_digests(private.x_val)))
    stored, private_stored = public.stored_image_digests, private.stored_image_digests
    if stored is not None and private_stored is not None:
        shared = max(shared, len(stored["train"] & (private_stored["train"] | private_stored["val"])))
    if shared:
        raise ConfigError(f"pretrain.data shares {shared} image(s) with the private training or validation data, "
                          "and pre-training is not private; pre-train on data disjoint from data (other classes "
                          "or another source), or set pretrain.enabled: false")


def check_pretraining(config: dict, private, output_dir: str) -> None:
    """The dry run's view of :func:`pretrain`: the model it would load, or the public data it would
    pre-train on, must take the private data's channels (loads, trains nothing)."""
    if not config["pretrain"]["enabled"]:
        return
    source, path = pretrained_source(config, output_dir)
    if source in ("checkpoint", "cache"):
        _loaded_pretrained(source, path, private)
    else:
        _public_data(config, private)


def pretrain(config: dict, output_dir: str, private) -> tf.keras.Model:
    """The pre-trained model: loaded (pretrain.checkpoint, or the cache ``pretrained.keras`` made under
    this configuration) or pre-trained non-privately on the public data and cached with its key; the
    public data (or the loaded model) must have the ``private`` data's channels."""
    from sparta_tf.data import make_augmenter
    from sparta_tf.models.zoo import build_model

    spec = config["pretrain"]
    source, path = pretrained_source(config, output_dir)
    if source in ("checkpoint", "cache"):
        print(f"== pre-trained model: {path}")
        return _loaded_pretrained(source, path, private)
    if source == "stale":
        print(f"== {path} was made under another pre-training configuration; pre-training again")
    public = _public_data(config, private)
    print(f"== non-private pre-training on public data {public.name} (n={len(public.x_train)})")
    model = build_model(config["model"], public.num_classes, public.input_shape)
    optimizer = (tf.keras.optimizers.Adam(spec["learning_rate"]) if spec["optimizer"] == "adam"
                 else tf.keras.optimizers.SGD(spec["learning_rate"], momentum=0.9))
    inputs = tf.keras.Input(public.input_shape)
    trainer = model
    if spec["augment"]:
        trainer = tf.keras.Model(inputs, model(make_augmenter(seed=data_seed(config))(inputs)))
    trainer.compile(optimizer, loss=LOSS, metrics=["accuracy"])
    trainer.fit(public.x_train, public.y_train, epochs=spec["epochs"], batch_size=spec["batch_size"],
                validation_data=(public.x_test, public.y_test), verbose=2)
    key_path = os.path.join(output_dir, PRETRAINED_KEY)
    if not spec["checkpoint"] and os.path.exists(key_path):
        os.remove(key_path)  # never a key next to a model it was not made for, even if killed in between
    replace_atomically(path, model.save, suffix=".keras")  # Keras picks the format by the suffix
    if not spec["checkpoint"]:
        write_atomic(key_path, json.dumps(pretraining_key(config), indent=1))
    return model


def load_pretrained(path: str, what: str) -> tf.keras.Model:
    """The Keras model saved at ``path`` (``what``: the config key naming it, for the one-line error)."""
    from sparta_tf.models.convert import load_keras_model

    try:
        return load_keras_model(path)
    except (ValueError, OSError) as error:
        raise ConfigError(f"{what}: {error}; point it at a model saved by Keras (or delete the cache)") from None
