#!/usr/bin/env python
"""Pre-trains the public models that sparta-tf ships (``sparta_tf/models/weights/``), non-privately.

Each model is trained once on the *public* half of a utility-benchmark track
and written as ``<name>.weights.h5`` plus a model card ``<name>.json``
(architecture, input shape, classes, public data, this command, epochs, test
accuracy on the public test split, SHA-256 of the weights), which
``model: {name: pretrained, weights: <name>}`` loads and checks.

* ``cifar5-resnet20-gn``: ResNet-20-GN on CIFAR-10 classes 0-4 (25,000 training
  images, flip + translate augmentation), SGD momentum 0.9, cosine learning rate;
* ``mnist-resnet20-gn``: ResNet-20-GN on MNIST (60,000 images, no augmentation);
* ``<name>-weak``: the same recipe on a tenth of the public training images (a
  weaker public model, to show how transfer quality moves the benchmark's ranking).

Runs resume: a finished model is skipped; each epoch is checkpointed and a killed
run continues from its last epoch. Example::

    python benchmarks/pretrain_public.py --data-dir ../shared/data --models mnist-resnet20-gn
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RECIPES = {
    "cifar5-resnet20-gn": {
        "data": {"source": "tar", "path": "cifar10-jpg.tar.gz", "classes": [0, 1, 2, 3, 4], "val_fraction": 0.05},
        "model": {"name": "resnet20_gn"}, "epochs": 60, "batch_size": 128, "learning_rate": 0.1,
        "weight_decay": 5e-4, "augment": True,
    },
    "mnist-resnet20-gn": {
        "data": {"source": "npz", "path": "mnist.npz", "val_fraction": 0.05},
        "model": {"name": "resnet20_gn"}, "epochs": 6, "batch_size": 128, "learning_rate": 0.1,
        "weight_decay": 5e-4, "augment": False,
    },
}
# Weaker public models for the benchmark's "how transfer quality moves the ranking" comparison:
# the same recipe on a tenth of the public training data.
for _strong in list(RECIPES):
    RECIPES[f"{_strong}-weak"] = dict(RECIPES[_strong], data=dict(RECIPES[_strong]["data"], limit_train={
        "cifar5-resnet20-gn": 2500, "mnist-resnet20-gn": 6000}[_strong]))


def train_public(name: str, data_dir: str, work_dir: str, out_dir: str, epochs: int | None,
                 limit: int | None = None) -> dict:
    import tensorflow as tf

    from sparta_tf.data import load_dataset, make_augmenter
    from sparta_tf.models.pretrained import sha256
    from sparta_tf.models.zoo import build_model

    recipe = dict(RECIPES[name])
    epochs = epochs or recipe["epochs"]
    # split: positions, pinned: the split the shipped public models were trained with (public data, no privacy at stake)
    spec = dict(recipe["data"], path=os.path.join(data_dir, recipe["data"]["path"]), split="positions")
    if limit:
        spec.update(limit_train=limit, limit_test=limit)
    data = load_dataset(spec, seed=0)
    tf.keras.utils.set_random_seed(0)
    model = build_model(recipe["model"], data.num_classes, data.input_shape)
    steps = epochs * -(-len(data.x_train) // recipe["batch_size"])
    schedule = tf.keras.optimizers.schedules.CosineDecay(recipe["learning_rate"], steps)
    optimizer = tf.keras.optimizers.SGD(schedule, momentum=0.9, weight_decay=recipe["weight_decay"])
    inputs = tf.keras.Input(data.input_shape)
    trainer = tf.keras.Model(inputs, model(make_augmenter(seed=0)(inputs))) if recipe["augment"] else model
    trainer.compile(optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    checkpoint_dir = os.path.join(work_dir, name)
    backup = tf.keras.callbacks.BackupAndRestore(checkpoint_dir)  # a killed run resumes at its last epoch
    start = time.perf_counter()
    trainer.fit(data.x_train, data.y_train, batch_size=recipe["batch_size"], epochs=epochs,
                validation_data=(data.x_val, data.y_val), callbacks=[backup], verbose=2)
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    _, accuracy = model.evaluate(data.x_test, data.y_test, verbose=0)
    weights = os.path.join(out_dir, f"{name}.weights.h5")
    model.save_weights(weights)
    card = {
        "name": name, "model": recipe["model"], "input_shape": list(data.input_shape),
        "num_classes": data.num_classes, "class_names": data.class_names, "public_data": recipe["data"],
        "training": {k: recipe[k] for k in ("batch_size", "learning_rate", "weight_decay", "augment")}
        | {"epochs": epochs, "optimizer": "SGD momentum 0.9, cosine decay", "seed": 0},
        "public_test_accuracy": round(float(accuracy), 4), "test_examples": int(len(data.y_test)),
        "train_seconds": round(time.perf_counter() - start, 1),
        "command": " ".join(["python", "benchmarks/pretrain_public.py"] + sys.argv[1:]),
        "sha256": sha256(weights),
    }
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(card, f, indent=1)
    return card


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="folder with mnist.npz and cifar10-jpg.tar.gz")
    parser.add_argument("--models", nargs="+", default=sorted(RECIPES), choices=sorted(RECIPES))
    parser.add_argument("--epochs", type=int, help="override the recipe's epochs (smoke runs)")
    parser.add_argument("--limit", type=int, help="train/test examples at most (smoke runs)")
    parser.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "pretrain_public"))
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "sparta_tf", "models", "weights"))
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    for name in args.models:
        if os.path.exists(os.path.join(args.out_dir, f"{name}.json")):
            print(f"{name}: already trained ({args.out_dir}), skipped")
            continue
        card = train_public(name, args.data_dir, args.work_dir, args.out_dir, args.epochs, args.limit)
        print(f"{name}: public test accuracy {card['public_test_accuracy']:.4f} in {card['train_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
