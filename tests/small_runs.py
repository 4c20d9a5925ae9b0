"""Running sparta-train in a fresh process from a test, and watching its files while it trains."""

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")  # sparta-train's environment: this one, C++ logs off


def wait_mid_epoch_after(out, epoch: int, deadline: float) -> bool:
    """Polls ``out`` (a run's output directory) until checkpoint ``epoch-{epoch}`` or a later one is
    written and the journal's last started step is neither the first nor the second of an epoch
    (``plan.json``'s steps per epoch): a kill now loses started steps after the checkpoint. False if
    ``time.time()`` passes ``deadline`` first."""
    journal, latest = out / "checkpoints" / "journal.json", out / "checkpoints" / "latest"
    while time.time() < deadline:
        try:
            if latest.exists() and latest.read_text() >= f"epoch-{epoch:04d}":
                per_epoch = json.loads((out / "plan.json").read_text())["steps_per_epoch"]
                if json.loads(journal.read_text())["started_through"] % per_epoch not in (0, 1):
                    return True
        except (OSError, ValueError):
            pass  # a file being replaced
        time.sleep(0.02)
    return False


def _command(config_path, args, module: str = "trainers") -> list[str]:
    return [sys.executable, "-m", module, "--config", str(config_path), *args]


def sparta_train(config_path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -m trainers --config CONFIG_PATH *ARGS`` in a fresh process from the repository root
    (TensorFlow's C++ logs off), waited for, its output captured as text."""
    return subprocess.run(_command(config_path, args), cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def start_sparta_train(config_path, **popen) -> subprocess.Popen:
    """The process of :func:`sparta_train` (no further arguments), started and not waited for; its output
    is discarded unless ``popen`` (``subprocess.Popen`` keywords) says otherwise."""
    return subprocess.Popen(_command(config_path, ()), cwd=ROOT, env=ENV,
                            **{"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, **popen})


def sparta_tune(config_path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``sparta-tune --config CONFIG_PATH *ARGS`` in a fresh process, as :func:`sparta_train`."""
    return subprocess.run(_command(config_path, args, "trainers.tune_cli"), cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def start_sparta_tune(config_path) -> subprocess.Popen:
    """The process of :func:`sparta_tune` (no further arguments), started and not waited for."""
    return subprocess.Popen(_command(config_path, (), "trainers.tune_cli"), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
