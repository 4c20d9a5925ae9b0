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

Run: ``sparta-example`` or ``python -m sparta_tf.examples.quickstart``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from sparta_tf import method_spec  # noqa: E402  (after the log level: the package imports TensorFlow)


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


METHOD_NAMES = tuple(method_spec.METHODS)
"""Every method, from the TensorFlow-free spec :mod:`sparta_tf.method_spec`."""


def _number(low: float, high: float, *, low_open: bool = True, high_open: bool = False, kind=float,
            interval: str | None = None):
    """An argparse type: a finite ``kind`` in the interval from ``low`` to ``high`` (open or closed ends)."""
    interval = interval or f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        inside = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"{text} must be {interval}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sparta-example", description=__doc__.splitlines()[0])
    positive = _number(0, math.inf, high_open=True, interval="> 0")
    parser.add_argument("--epsilon", type=positive, default=4.0,
                        help="target epsilon of the whole run, > 0 (default 4)")
    parser.add_argument("--delta", type=_number(0, 1, high_open=True, interval="in (0, 1)"), default=1e-5, help="delta in (0, 1)")
    count = _number(1, math.inf, low_open=False, kind=int, interval="an integer >= 1")
    parser.add_argument("--epochs", type=count, default=15,
                        help="DP fine-tuning epochs (sparta and its kin need at least 3)")
    parser.add_argument("--pretrain-epochs", type=count, default=15,
                        help="non-private pre-training epochs on the public digits")
    parser.add_argument("--sample-rate", type=_number(0, 1, interval="in (0, 1]"), default=0.1,
                        help="Poisson rate q in (0, 1]")
    parser.add_argument("--method", default="sparta", choices=METHOD_NAMES, metavar="METHOD",
                        help=f"one of {', '.join(METHOD_NAMES)} (default sparta; docs/methods.md)")
    parser.add_argument("--lr", type=positive, default=0.05,
                        help="learning rate of the backbone")
    parser.add_argument("--head-lr", type=positive, default=0.5,
                        help="learning rate of the fresh head (paper: 10x)")
    parser.add_argument("--density", type=_number(0, 1, interval="in (0, 1]"), default=0.2,
                        help="fraction of rows kept per layer, in (0, 1] (sparta, dpsgd_grad, oracle, mp, random)")
    parser.add_argument("--seed", type=_number(0, 2**63, low_open=False, high_open=True, kind=int,
                                               interval="an integer in [0, 2**63)"), default=None,
                        help="seed for reproducible runs (default: secret)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    """Runs the example; a bad argument is one line (argparse's), and so is a method that cannot run."""
    args = parse_args(argv)
    try:
        run(args)
    except ValueError as error:
        print(f"sparta-example: error: {str(error).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None


def _fits(method, epochs: int) -> bool:
    try:
        method.phases(epochs)
    except ValueError:
        return False
    return True


def run(args: argparse.Namespace) -> None:
    """Pre-training, then DP fine-tuning by ``args.method`` as ``sparta-train`` runs a method: its privacy
    plan (mechanisms before training included), its DP model, its preparation, then ``fit``."""
    import tensorflow as tf

    from sparta_tf import MethodCallback, methods
    from sparta_tf.privacy.plan import make_privacy_plan

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
    n, q = len(private[0]), args.sample_rate
    plan = make_privacy_plan(
        n=n, expected_batch_size=q * n, phases=method.phases(args.epochs), delta=args.delta,
        target_epsilon=args.epsilon, before_training=method.mechanisms_before_training(n, q),
        training_share=method.training_share, nonprivate_reasons=method.nonprivate_reasons())
    print(plan.describe())
    dp_model = method.make_dp_model(model, noise_multiplier=plan.noise_multiplier, clip_norm=1.0,
                                    sample_rate=plan.sample_rate, dataset_size=n, delta=args.delta,
                                    target_epsilon=args.epsilon, seed=args.seed)
    dp_model.compile(tf.keras.optimizers.SGD(args.lr, momentum=0.9), loss=loss, metrics=["accuracy"])
    method.prepare(dp_model, *private, loss, plan)  # DP-FROST's selection, DP-SSGD's pruning; else nothing
    dp_model.fit(*private, epochs=args.epochs, validation_data=test, callbacks=[MethodCallback(method)], verbose=2)

    accuracy = dp_model.evaluate(*test, verbose=0)[1]
    print(dp_model.ledger.report())
    print(f"== private test accuracy {accuracy:.3f} at epsilon={dp_model.ledger.epsilon():.3f}, delta={args.delta}")


if __name__ == "__main__":
    main()
