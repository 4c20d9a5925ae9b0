"""Quickstart: public pre-training, then DP fine-tuning with a calibrated (epsilon, delta).

Bundled data only (scikit-learn's 8x8 digits, no network):

1. non-private pre-training on the "public" digits 0-4;
2. DP fine-tuning with a fresh head on the "private" digits 5-9 by SPARTA
   (``--method``: warm-up on biases/norms/head, one private row-selection
   epoch, sparse DP-SGD on the top 20% rows per layer) or any other method
   of :data:`sparta_tf.methods.METHODS`, run as ``sparta-train`` runs it (its
   privacy plan, with DP-FROST's selection rounds or DP-SNIP charged, its DP
   model, its preparation before ``fit``), with the noise multiplier
   calibrated so the whole run spends at most ``--epsilon`` (Poisson
   sampling, PLD accountant);
3. prints epsilon spent per epoch, the privacy report and test accuracy.

Run: ``sparta-example`` (its arguments: :mod:`trainers.example`).
"""

from __future__ import annotations

import argparse


def load_digits_split():
    """(public x, y), (private train x, y), (private test x, y) from sklearn digits; the test split is drawn
    from the ``test_split`` stream of seed 0 (:mod:`sparta_tf.random_streams`), the same in every run."""
    import numpy as np
    from sklearn.datasets import load_digits

    from sparta_tf import random_streams

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int32")
    public = y < 5
    rng = random_streams.numpy_rng(0, "test_split")
    private_idx = rng.permutation(np.flatnonzero(~public))
    test_idx, train_idx = private_idx[:200], private_idx[200:]
    return (x[public], y[public]), (x[train_idx], y[train_idx] - 5), (x[test_idx], y[test_idx] - 5)


def build_model(num_classes: int):
    import tensorflow as tf

    layers = tf.keras.layers
    inputs = layers.Input((8, 8, 1))
    h = layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(inputs)
    h = layers.GroupNormalization(4, name="gn1")(h)
    h = layers.Conv2D(32, 3, strides=2, padding="same", activation="relu", name="conv2")(h)
    h = layers.GroupNormalization(4, name="gn2")(h)
    h = layers.GlobalAveragePooling2D()(h)
    features = tf.keras.Model(inputs, h, name="features")
    outputs = layers.Dense(num_classes, name="head")(features(inputs))
    return tf.keras.Model(inputs, outputs), features


def _fits(method, epochs: int) -> bool:
    try:
        method.phases(epochs)
    except ValueError:
        return False
    return True


def run(args: argparse.Namespace) -> None:
    """Pre-training, then DP fine-tuning by ``args.method`` through :func:`sparta_tf.make_private` (the
    method's privacy plan, mechanisms before training included, its DP model, its preparation, ``fit``)."""
    import tensorflow as tf

    import sparta_tf
    from sparta_tf import methods

    method_options = methods.method_class(args.method).options
    options = {"density": args.density} if "density" in method_options else {}
    method = methods.make_method(args.method, head_learning_rate_scale=args.head_lr / args.lr, **options)
    try:
        method.phases(args.epochs)
    except ValueError:  # before any training
        fewest = next(e for e in range(args.epochs + 1, 10**6) if _fits(method, e))
        raise ValueError(f"--epochs {args.epochs} is too few for --method {args.method}; give at least {fewest}") from None

    public, private, test = load_digits_split()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    print("== 1. non-private pre-training on public digits 0-4")
    pretrained, features = build_model(5)
    pretrained.compile(tf.keras.optimizers.Adam(3e-3), loss=loss, metrics=["accuracy"])
    pretrained.fit(*public, epochs=args.pretrain_epochs, batch_size=64, verbose=0)
    print(f"   public accuracy: {pretrained.evaluate(*public, verbose=0)[1]:.3f}")

    print(f"== 2. DP fine-tuning ({args.method}) on private digits 5-9 (fresh head)")
    inputs = tf.keras.Input((8, 8, 1))
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(5, name="head")(features(inputs)))
    n = len(private[0])
    dp_model = sparta_tf.make_private(model, method=method, target_epsilon=args.epsilon, delta=args.delta,
                                      epochs=args.epochs, batch_size=args.sample_rate * n, dataset_size=n,
                                      clip_norm=1.0, seed=args.seed)
    print(dp_model.plan.describe())
    dp_model.compile(tf.keras.optimizers.SGD(args.lr, momentum=0.9), loss=loss, metrics=["accuracy"])
    dp_model.fit(*private, validation_data=test, verbose=2)

    accuracy = dp_model.evaluate(*test, verbose=0)[1]
    print(dp_model.ledger.report())
    print(f"== private test accuracy {accuracy:.3f} at epsilon={dp_model.ledger.epsilon():.3f}, delta={args.delta}")
