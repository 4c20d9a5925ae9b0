"""Quickstart: public pre-training, then DP fine-tuning with a calibrated (epsilon, delta).

Bundled data only (scikit-learn's 8x8 digits, no network):

1. non-private pre-training on the "public" digits 0-4;
2. DP fine-tuning with a fresh head on the "private" digits 5-9 by SPARTA
   (``--method``: warm-up on biases/norms/head, one private row-selection
   epoch, sparse DP-SGD on the top 20% rows per layer) or any baseline, with
   the noise multiplier calibrated so the whole run spends at most
   ``--epsilon`` (Poisson sampling, PLD accountant);
3. prints epsilon spent per epoch, the privacy report and test accuracy.

Run: ``sparta-example`` or ``python -m sparta_tf.examples.quickstart``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--method", default="sparta", help="sparta (default), all, last, bitfit, x_bitfit, mp, random, "
                        "dpsgd_grad, oracle")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of the backbone")
    parser.add_argument("--head-lr", type=float, default=0.5, help="learning rate of the fresh head (paper: 10x)")
    parser.add_argument("--density", type=float, default=0.2, help="fraction of rows kept per layer (sparse methods)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible runs (default: secret)")
    args = parser.parse_args(argv)

    import tensorflow as tf

    from sparta_tf import DPModel, MethodCallback, methods
    from sparta_tf.privacy import calibrate_noise_multiplier, steps_per_epoch

    public, private, test = load_digits_split()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    print("== 1. non-private pre-training on public digits 0-4")
    pretrained, features = build_model(5)
    pretrained.compile(tf.keras.optimizers.Adam(3e-3), loss=loss, metrics=["accuracy"])
    pretrained.fit(*public, epochs=15, batch_size=64, verbose=0)
    print(f"   public accuracy: {pretrained.evaluate(*public, verbose=0)[1]:.3f}")

    print(f"== 2. DP fine-tuning ({args.method}) on private digits 5-9 (fresh head)")
    inputs = tf.keras.Input((8, 8, 1))
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(5, name="head")(features(inputs)))
    n, q = len(private[0]), args.sample_rate
    steps = args.epochs * steps_per_epoch(q)
    sigma = calibrate_noise_multiplier(args.epsilon, args.delta, q, steps)
    print(f"   n={n} q={q} steps={steps} -> noise_multiplier={sigma:.3f} for epsilon={args.epsilon}")
    dp_model = DPModel(model, noise_multiplier=sigma, clip_norm=1.0, sample_rate=q,
                       delta=args.delta, target_epsilon=args.epsilon, seed=args.seed)
    dp_model.compile(tf.keras.optimizers.SGD(args.lr, momentum=0.9), loss=loss, metrics=["accuracy"])
    options = {"density": args.density} if "density" in methods.method_class(args.method).options else {}
    callback = MethodCallback(args.method, head_learning_rate_scale=args.head_lr / args.lr, **options)
    dp_model.fit(*private, epochs=args.epochs, validation_data=test, callbacks=[callback], verbose=2)

    accuracy = dp_model.evaluate(*test, verbose=0)[1]
    print(dp_model.ledger.report())
    print(f"== private test accuracy {accuracy:.3f} at epsilon={dp_model.ledger.epsilon():.3f}, delta={args.delta}")


if __name__ == "__main__":
    main()
