"""A tiny DPModel run, as one process of a multi-worker cluster or alone (tests/test_multi_worker.py).

    python tests/multi_worker_job.py OUT_DIR SIGMA STRATEGY [SEED [DATA]]   (STRATEGY: default | multi_worker;
                                      SEED: an int or none, default 123; DATA: same (default) | per-worker,
                                      each worker's own arrays)

Writes ``OUT_DIR/weights.npz`` and ``OUT_DIR/ledger.json`` from the chief (or
the single process); other workers write to their scratch directory
(:func:`sparta_tf.distribute.worker_dir`).
"""

import json
import os
import sys

import numpy as np

from sparta_tf import distribute


def main(out_dir: str, sigma: float, strategy_name: str, seed: int | None = 123, data: str = "same") -> None:
    strategy = distribute.make_strategy(strategy_name, peer_deadline_s=60)  # before any other TF op
    import tensorflow as tf

    from sparta_tf.dp_model import DPModel

    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0 if data == "same" or distribute.is_chief(strategy) else 1)
    x = rng.normal(size=(48, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, 48).astype("int32")
    with strategy.scope():
        inputs = tf.keras.Input((6, 6, 2))
        h = tf.keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
        h = tf.keras.layers.GroupNormalization(2)(h)
        h = tf.keras.layers.GlobalAveragePooling2D()(h)
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(3)(h))
        dp = DPModel(model, noise_multiplier=sigma, sample_rate=0.25, physical_batch_size=8,
                     delta=1e-5, seed=seed)
        dp.compile(tf.keras.optimizers.SGD(0.3, momentum=0.9),
                   loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dp.fit(x, y, epochs=2, verbose=0)
    target = distribute.worker_dir(out_dir, strategy)
    os.makedirs(target, exist_ok=True)
    np.savez(os.path.join(target, "weights.npz"), *[v.numpy() for v in model.weights])
    with open(os.path.join(target, "ledger.json"), "w") as f:
        json.dump({"ledger": dp.ledger.to_json(), "epsilon": dp.ledger.epsilon() if sigma > 0 else None,
                   "dp_step": int(dp.dp_step.numpy()), "seed": dp.seed}, f)  # a test: the seed may show


if __name__ == "__main__":
    seed_arg = sys.argv[4] if len(sys.argv) > 4 else "123"
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], None if seed_arg == "none" else int(seed_arg), *sys.argv[5:6])
