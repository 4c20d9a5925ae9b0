"""``training.deterministic``: two sparta-train processes with one seed end on the same bits.

A seed fixes the batches and the noise; without ``deterministic`` the
floating-point arithmetic between them may still differ between processes
(:mod:`sparta_tf.determinism`), so the comparison runs two fresh processes.
"""

import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(output_dir, deterministic):
    """SPARTA from a shipped pre-trained model: without ``deterministic``, two processes of this config
    end with 118 of their 122 checkpoint tensors different (measured; at twice the examples and batch they
    drifted apart within the first epoch, in the 7th digit of the loss)."""
    return {
        "data": {"source": "synthetic", "num_examples": 620, "num_classes": 10, "val_fraction": 0.1,
                 "test_fraction": 0.1, "image_size": [28, 28], "channels": 1},
        "model": {"name": "pretrained", "weights": "mnist-resnet20-gn"},
        "method": {"name": "sparta", "density": 0.2, "warmup_epochs": 1},
        "privacy": {"target_epsilon": 1.0, "delta": 1e-5},
        "training": {"epochs": 3, "batch_size": 125, "learning_rate": 0.3, "head_learning_rate": 3.0, "seed": 0,
                     "deterministic": deterministic},
        "export": {"enabled": False},
        "output_dir": str(output_dir),
    }


def _train_in_fresh_processes(tmp_path, names, deterministic):
    """One sparta-train process per name, all at once (each its own process and output directory); the
    final checkpoint of each."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    processes = []
    for name in names:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(_config(tmp_path / name, deterministic)))
        with open(tmp_path / f"{name}.log", "w") as log:  # a file, not a pipe: neither waits on a full pipe
            processes.append(subprocess.Popen([sys.executable, "-m", "trainers", "--config", str(path)], cwd=ROOT,
                                              env=env, stdout=log, stderr=subprocess.STDOUT))
    for name, process in zip(names, processes):
        process.wait(timeout=900)
        assert process.returncode == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    return [_final_checkpoint(tmp_path / name) for name in names]


def _final_checkpoint(run_dir):
    """Every tensor of the run's last checkpoint (weights and optimizer state), by name."""
    epochs = sorted(p for p in os.listdir(run_dir / "checkpoints") if p.startswith("epoch-"))
    reader = tf.train.load_checkpoint(str(run_dir / "checkpoints" / epochs[-1] / "ckpt"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if "OBJECT_GRAPH" not in name}


def test_deterministic_runs_in_two_processes_end_bit_identical(tmp_path):
    first, second = _train_in_fresh_processes(tmp_path, ["first", "second"], deterministic=True)
    assert first.keys() == second.keys() and len(first) > 10
    differing = [name for name in first if not np.array_equal(first[name], second[name])]
    assert not differing, f"{len(differing)} of {len(first)} checkpoint tensors differ, e.g. {differing[:3]}"
