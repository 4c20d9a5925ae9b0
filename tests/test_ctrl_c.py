"""Ctrl-C in sparta-example, sparta-check-export and sparta-audit: one line on stderr, exit status 130.

Regression: only sparta-train handled SIGINT; the three other tools ended in a
KeyboardInterrupt traceback. Each test starts the tool in a fresh process,
waits until it is busy (a line on stdout, or a file it writes), sends SIGINT
as a terminal's Ctrl-C would, and reads what the tool said. (sparta-train's
own test is in ``test_cli_run.py``.)
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from small_configs import tiny_config
from small_runs import ENV, ROOT
from trainers import audit, check_export, example
from trainers.config import validate
from trainers.interrupt import INTERRUPTED

PATIENCE = 240  # seconds until the tool is busy, on a loaded 2-core machine


def _start(module: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """``python -m module *args`` from the repository root, stdout unbuffered, SIGINT as in a terminal."""
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, text=True,
                            env={**(env or ENV), "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _interrupt(process: subprocess.Popen, busy, settle: float = 0.0) -> tuple[list[str], str]:
    """Sends SIGINT ``settle`` seconds after ``busy(stdout lines so far)`` is true; returns (stdout lines,
    stderr)."""
    lines: queue.Queue = queue.Queue()
    err: list[str] = []
    readers = [threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True),
               threading.Thread(target=lambda: err.append(process.stderr.read()), daemon=True)]
    for reader in readers:
        reader.start()
    seen: list[str] = []
    deadline = time.time() + PATIENCE
    try:
        while not busy(seen):
            assert process.poll() is None, f"the tool ended before it was interrupted (status {process.returncode})"
            assert time.time() < deadline, f"the tool was not busy within {PATIENCE} s: {seen}"
            try:
                seen.append(lines.get(timeout=0.01))
            except queue.Empty:
                pass
        time.sleep(settle)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for reader in readers:
            reader.join(timeout=10)
    while not lines.empty():
        seen.append(lines.get())
    return seen, "".join(err)


def _assert_one_line(process: subprocess.Popen, err: str, expected: str) -> None:
    assert process.returncode == INTERRUPTED and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines() == [expected], err[-3000:]


def test_ctrl_c_in_sparta_example_is_one_line():
    """Interrupted in the pre-training's ``fit`` (which 100000 epochs keep busy)."""
    process = _start("trainers.example", "--pretrain-epochs", "100000", "--seed", "0")
    out, err = _interrupt(process, lambda seen: any(line.startswith("== 1.") for line in seen), settle=1.0)
    assert not any(line.startswith("== 2.") for line in out), "the pre-training finished first"
    _assert_one_line(process, err, example.INTERRUPTED_LINE)


def test_ctrl_c_in_sparta_check_export_is_one_line_and_leaves_no_scratch_files(tmp_path, write_config):
    """Interrupted while the serving process runs (its scratch folder holds the test images)."""
    run_dir, scratch = tmp_path / "run", tmp_path / "scratch"
    scratch.mkdir()
    run_dir.mkdir()
    (run_dir / "results.json").write_text(json.dumps({"test_accuracy": 0.5, "export_dir": str(tmp_path / "export")}))
    path = write_config(tiny_config(run_dir))
    process = _start("trainers.check_export", "--config", path, env={**ENV, "TMPDIR": str(scratch)})
    _, err = _interrupt(process, lambda seen: any(files for _, _, files in os.walk(scratch)))
    _assert_one_line(process, err, check_export.INTERRUPTED_LINE)
    assert not os.listdir(scratch)


def test_ctrl_c_in_sparta_audit_is_one_line_saying_how_to_start_over(tmp_path, write_config):
    """Interrupted in the audit's training run, a second after it planted the canaries (100 epochs keep it
    from finishing first; its run directory exists by then)."""
    config = tiny_config(tmp_path / "run", "bitfit", epochs=100)
    path = write_config(config)
    process = _start("trainers.audit", "--config", path, "--canaries", "20")
    _, err = _interrupt(process, lambda seen: any(line.startswith("== audit:") for line in seen), settle=1.0)
    assert not (tmp_path / "run" / "audit" / "audit.json").exists(), "the audit finished first"
    expected = audit.interrupted_line(validate(config))
    assert f"delete {tmp_path / 'run' / 'audit'} and run the same command again" in expected
    _assert_one_line(process, err, expected)
