"""Multi-worker DP-SGD (MultiWorkerMirroredStrategy): the cluster checks and two real worker processes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from small_configs import tiny_config
from small_runs import wait_mid_epoch_after
from sparta_tf.distribute import Cluster, ClusterError, parse_tf_config, wait_for_peers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "multi_worker_job.py")
TIMEOUT_S = 240


def tf_config(ports, index, job="worker"):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": job, "index": index}})


def worker_env(**extra):
    """This process's environment with the repository first on PYTHONPATH, TF's C++ logs off, and ``extra``."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="3",
                **extra)


def free_ports(k):
    sockets = [socket.socket() for _ in range(k)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


# ----------------------------------------------------------------- TF_CONFIG


def test_a_valid_tf_config_names_the_task_and_the_chief():
    cluster = parse_tf_config(tf_config([1111, 2222], 1))
    assert cluster == Cluster({"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}, "worker", 1)
    assert not cluster.is_chief and cluster.num_workers == 2
    assert cluster.peers == [("worker", 0, "127.0.0.1:1111")]
    assert parse_tf_config(tf_config([1111, 2222], 0)).is_chief
    with_chief = parse_tf_config(json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:2"]},
                                             "task": {"type": "worker", "index": 0}}))
    assert not with_chief.is_chief


@pytest.mark.parametrize("text, message", [
    (None, "needs the TF_CONFIG environment variable"),
    ("{not json", "TF_CONFIG is not JSON"),
    ('{"task": {"type": "worker", "index": 0}}', "no 'cluster' object"),
    ('{"cluster": {"ps": ["a:1"], "worker": ["b:2"]}, "task": {"type": "worker", "index": 0}}', "not supported"),
    ('{"cluster": {"worker": ["a1"]}, "task": {"type": "worker", "index": 0}}', "is not 'host:port'"),
    ('{"cluster": {"worker": ["a:99999"]}, "task": {"type": "worker", "index": 0}}', "port in 1..65535"),
    ('{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}', "listed twice"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}', "out of range"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}', "each host sets its own task"),
    ('{"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}}', "must be a list"),
])
def test_a_malformed_tf_config_is_one_line_naming_the_fix(text, message):
    with pytest.raises(ClusterError, match=message) as error:
        parse_tf_config(text)
    assert "\n" not in str(error.value)


def test_an_unreachable_peer_fails_fast_with_one_line():
    port, = free_ports(1)  # nothing listens there
    cluster = parse_tf_config(tf_config([free_ports(1)[0], port], 0))
    start = time.monotonic()
    with pytest.raises(ClusterError, match=rf"worker\[1\] at 127.0.0.1:{port} is unreachable after 1 s") as error:
        wait_for_peers(cluster, deadline_s=1.0, connect_timeout_s=0.5)
    assert time.monotonic() - start < 30
    assert "\n" not in str(error.value)


# ------------------------------------------------------- a peer that never joins, through the CLI

CLI_CONFIG = {
    "data": {"source": "digits", "classes": [0, 1, 2], "val_fraction": 0.1},
    "model": {"name": "cifar_resnet_gn", "depth": 8, "width": 4},
    "privacy": {"target_epsilon": 8.0, "delta": 1e-4},
    "training": {"epochs": 3, "batch_size": 64, "seed": 0, "strategy": "multi_worker"},
}


def start_cli_worker(tmp_path, ports, index=0, deadline_s=3):
    """``python -m trainers`` as worker ``index`` of a cluster on ``ports`` (its own process group)."""
    import yaml

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(dict(CLI_CONFIG, output_dir=str(tmp_path / "run"))))
    env = worker_env(TF_CONFIG=tf_config(ports, index), SPARTA_PEER_TIMEOUT_S=str(deadline_s))
    return subprocess.Popen([sys.executable, "-m", "trainers", "--config", str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc, timeout):
    """(status, stderr lines without notes); the process group is killed if it outlives ``timeout``."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the worker still ran after {timeout} s (a hang)")
    return proc.returncode, [line for line in err.strip().splitlines() if not line.startswith("note:")]


def test_cli_worker_whose_peer_never_comes_up_fails_in_one_line_after_the_deadline(tmp_path):
    """Regression: TensorFlow's collective set-up waited for the missing peer without a deadline, printing
    nothing and deaf to SIGTERM; the wait for the peers comes first and has one."""
    ports = free_ports(2)  # nothing listens on ports[1]
    start = time.monotonic()
    status, lines = finish(start_cli_worker(tmp_path, ports, deadline_s=3), timeout=120)
    assert status == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: cluster peer worker[1] at 127.0.0.1:{ports[1]} is unreachable after 3 s "
                               "(Connection refused); start every task listed in TF_CONFIG"), lines
    assert time.monotonic() - start < 100


def test_cli_worker_refuses_a_peer_port_held_by_something_else(tmp_path):
    """A port that accepts connections but is neither a waiting worker nor a TensorFlow server (here a
    bare listener) would make TensorFlow's set-up wait for ever."""
    ports = free_ports(2)
    with socket.create_server(("127.0.0.1", ports[1])):
        status, lines = finish(start_cli_worker(tmp_path, ports, deadline_s=3), timeout=120)
    assert status == 1 and len(lines) == 1, lines
    assert "is unreachable after 3 s (its port answers, but not as a sparta-train worker" in lines[0], lines


def test_a_waiting_cli_worker_answers_on_its_port_and_dies_on_sigterm(tmp_path):
    ports = free_ports(2)
    proc = start_cli_worker(tmp_path, ports, deadline_s=300)
    try:
        greeted, end = b"", time.monotonic() + 90
        while time.monotonic() < end and not greeted.startswith(b"sparta-tf"):
            try:
                with socket.create_connection(("127.0.0.1", ports[0]), timeout=2) as sock:
                    sock.settimeout(2)
                    greeted = sock.recv(64)
            except OSError:
                time.sleep(0.2)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        status, _ = finish(proc, timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert greeted.startswith(b"sparta-tf worker waiting"), greeted
    assert status == -signal.SIGTERM


def test_the_peer_deadline_variable_is_checked_by_the_plan(monkeypatch):
    from trainers.run import strategy_line

    monkeypatch.setenv("TF_CONFIG", tf_config([1111, 2222], 0))
    monkeypatch.setenv("SPARTA_PEER_TIMEOUT_S", "2.5")
    assert strategy_line("multi_worker").endswith("= chief; waits up to 2.5 s for its peers")
    monkeypatch.setenv("SPARTA_PEER_TIMEOUT_S", "soon")
    with pytest.raises(ClusterError, match="SPARTA_PEER_TIMEOUT_S='soon' must be a number of seconds > 0"):
        strategy_line("multi_worker")


# ------------------------------------------------------------ two processes


def start_job(out_dir, sigma, workers, *args) -> list[tuple[int, str]]:
    """Each process's (status, output) of the tiny job alone (workers=1) or as `workers` processes on
    127.0.0.1 (``args``: the job's SEED and DATA)."""
    ports = free_ports(workers)
    procs = []
    try:
        for index in range(workers):
            env = worker_env(TF_CONFIG=tf_config(ports, index)) if workers > 1 else worker_env()
            strategy = "multi_worker" if workers > 1 else "default"
            procs.append(subprocess.Popen([sys.executable, JOB, str(out_dir), str(sigma), strategy, *args], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
        outputs = [proc.communicate(timeout=TIMEOUT_S)[0].decode() for proc in procs]
    finally:
        kill_all(procs)
    return [(proc.returncode, output) for proc, output in zip(procs, outputs)]


def run_job(out_dir, sigma, workers, seed="123"):
    """Runs the tiny job alone (workers=1) or as `workers` processes on 127.0.0.1; returns the chief's files."""
    for status, output in start_job(out_dir, sigma, workers, seed):
        assert status == 0, output[-3000:]
    weights = np.load(os.path.join(out_dir, "weights.npz"))
    with open(os.path.join(out_dir, "ledger.json")) as f:
        return [weights[k] for k in sorted(weights.files, key=lambda k: int(k.split("_")[1]))], json.load(f)


@pytest.mark.parametrize("sigma", [0.0, 1.3])
def test_two_workers_train_the_single_process_model_and_spend_the_same_epsilon(tmp_path, sigma):
    """Same seed: one global Poisson sample per step split among the workers, clipped sums all-reduced,
    noise added once. Counting an example twice, a worker's own sample or its own noise would all
    change the weights; the ledger must hold exactly the single run's steps."""
    single_weights, single = run_job(tmp_path / "single", sigma, 1)
    multi_weights, multi = run_job(tmp_path / "multi", sigma, 2)
    for a, b in zip(single_weights, multi_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert multi["ledger"] == single["ledger"] and multi["dp_step"] == single["dp_step"] == 8
    assert multi["epsilon"] == single["epsilon"]
    worker1 = tmp_path / "multi.worker-worker-1"
    other_weights = np.load(worker1 / "weights.npz")  # the other worker wrote to its own scratch
    for a, k in zip(multi_weights, sorted(other_weights.files, key=lambda k: int(k.split("_")[1]))):
        np.testing.assert_array_equal(a, other_weights[k])


def test_without_a_seed_every_worker_uses_the_chiefs_secret_seed(tmp_path):
    """seed=None: each process draws a secret seed; unless the chief's is shared, the workers draw their
    shares from different Poisson samples. (The noise seed is a mirrored variable, which MWMS broadcasts
    from the chief anyway, so equal weights alone would not show this: the seed itself is compared.)"""
    chief_weights, chief = run_job(tmp_path / "multi", 1.3, 2, seed="none")
    other_dir = tmp_path / "multi.worker-worker-1"
    assert json.loads((other_dir / "ledger.json").read_text())["seed"] == chief["seed"]  # the sampling seed too
    other = np.load(other_dir / "weights.npz")
    for a, k in zip(chief_weights, sorted(other.files, key=lambda k: int(k.split("_")[1]))):
        np.testing.assert_array_equal(a, other[k])


def test_workers_whose_arrays_differ_stop_with_one_line_before_a_step(tmp_path):
    """Each worker gathers its share of a step by position from its own arrays: with other arrays an example
    could be in two workers' shares of one step. Both workers must stop before the first step, alike."""
    finished = start_job(tmp_path / "multi", 1.3, 2, "123", "per-worker")
    for status, output in finished:
        assert status != 0 and "the workers hold different training examples" in output, output[-3000:]
    assert not (tmp_path / "multi" / "ledger.json").exists()


# ------------------------------------------------- sparta-train, kill -9, --resume


def cli_config(out):
    """:func:`small_configs.tiny_config` as SPARTA with one warm-up epoch, 3 epochs of batch 12 on the
    multi-worker strategy, no export."""
    config = tiny_config(out, "sparta", epochs=3, batch_size=12, strategy="multi_worker")
    config["method"]["warmup_epochs"] = 1
    config["export"] = {"enabled": False}
    return config


def start_workers(config_path, ports, *extra):
    return [subprocess.Popen([sys.executable, "-m", "trainers", "--config", str(config_path), *extra], cwd=ROOT,
                             env=worker_env(TF_CONFIG=tf_config(ports, i)), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True) for i in range(len(ports))]


def kill_all(procs):
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def resume_all_to_the_end(config_path, exit_code=0) -> list[str]:
    """Both workers with --resume, run to their end: each one's output (both must exit ``exit_code``)."""
    procs = start_workers(config_path, free_ports(2), "--resume")
    try:
        outputs = [proc.communicate(timeout=TIMEOUT_S)[0].decode() for proc in procs]
    finally:
        kill_all(procs)
    assert [p.returncode for p in procs] == [exit_code, exit_code], "\n".join(o[-2500:] for o in outputs)
    return outputs


def test_kill_9_one_worker_then_resume_all_never_undercounts(tmp_path):
    out = tmp_path / "run"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cli_config(out)))  # JSON is YAML
    ports = free_ports(2)
    procs = start_workers(path, ports)
    try:
        assert wait_mid_epoch_after(out, 2, time.time() + TIMEOUT_S), "no mid-epoch point after the mask"
        os.killpg(procs[1].pid, signal.SIGKILL)  # the non-chief worker dies mid-epoch
        procs[1].wait()
    finally:
        kill_all(procs)  # the chief is stuck in a collective: restart all, as a user would
    assert not (out / "results.json").exists(), "the run finished before it could be killed"
    mask_before = dict(np.load(out / "mask" / "mask.npz"))
    state = json.loads((out / "checkpoints" / (out / "checkpoints" / "latest").read_text() / "state.json").read_text())
    started = max(json.loads((directory / "checkpoints" / "journal.json").read_text())["started_through"]
                  for directory in (out, tmp_path / "run.worker-worker-1"))  # each worker's journal: the largest

    resume_all_to_the_end(path)
    per_epoch = json.loads((out / "plan.json").read_text())["steps_per_epoch"]
    results = json.loads((out / "results.json").read_text())
    ledger = json.loads((out / "ledger.json").read_text())
    phases = {}
    for entry in ledger["entries"]:
        phases[entry.get("phase")] = phases.get(entry.get("phase"), 0) + entry["count"]
    assert phases.get("interrupted", 0) == started - state["epoch"] * per_epoch > 0  # the killed epoch stays charged
    assert results["steps"] == sum(phases.values()) >= started
    assert results["epsilon"] <= 8.0 + 1e-6
    mask_after = np.load(out / "mask" / "mask.npz")
    assert set(mask_after.files) == set(mask_before)
    for key in mask_before:  # restored, not selected again
        np.testing.assert_array_equal(mask_after[key], mask_before[key])
    other = tmp_path / "run.worker-worker-1"
    assert json.loads((other / "ledger.json").read_text())["entries"] != [] and (other / "results.json").exists()
    assert not (out / ".worker-worker-1").exists()


def test_workers_whose_journals_disagree_all_charge_the_largest_count(tmp_path):
    """A kill leaves each worker's journal at its own step. If each charged its own count, their ledgers
    (and the step at which the budget stops training) would differ: one worker would leave the epoch
    while the other waits in its next step's all-reduce. Here only worker 1 journaled 3 started steps
    (killed before any checkpoint): both must charge 3, start at step 3 and finish. Without a seed, each
    worker draws a secret split key: the chief's must be every worker's."""
    out = tmp_path / "run"
    config = cli_config(out)
    config["method"] = {"name": "all"}  # one phase to trace: the journals, not the method, are under test
    config["training"]["epochs"] = 2
    config["training"]["seed"] = None  # a secret split key, drawn by each worker and the chief's shared
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    journal = tmp_path / "run.worker-worker-1" / "checkpoints" / "journal.json"
    journal.parent.mkdir(parents=True)
    journal.write_text(json.dumps({"started_through": 3}))

    outputs = resume_all_to_the_end(path)
    keys = [json.loads((directory / "data_split.json").read_text())["key"]
            for directory in (out, tmp_path / "run.worker-worker-1")]
    assert keys[0] == keys[1]  # else each worker held out other examples (and the arrays check refuses)
    for directory in (out, tmp_path / "run.worker-worker-1"):
        entries = json.loads((directory / "ledger.json").read_text())["entries"]
        assert sum(e["count"] for e in entries if e.get("phase") == "interrupted") == 3
    assert all("3 step(s) of the interrupted run" in output for output in outputs)


def test_workers_that_find_different_checkpoints_stop_with_one_line_instead_of_hanging(tmp_path):
    """Regression: a worker without a checkpoint starts fresh and runs DP-SNIP's before-training charge
    (one more collective) while a restored worker does not, so their collectives paired up wrongly and
    the run could hang. Both must stop at the first collective with the same one-line error."""
    import shutil

    out, other = tmp_path / "run", tmp_path / "run.worker-worker-1"
    config = cli_config(out)
    config["method"] = {"name": "dp_ssgd", "prune": "dp_snip", "prune_rate": 0.5}
    config["training"]["epochs"] = 1
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    resume_all_to_the_end(path)
    for directory in (out, other):
        (directory / "results.json").unlink()
    shutil.rmtree(other / "checkpoints")  # worker 1 lost its checkpoint; the chief kept epoch 1

    outputs = resume_all_to_the_end(path, exit_code=1)  # both stop at the check
    assert "(this one: epoch 1)" in outputs[0] and "(this one: none)" in outputs[1]
    assert all("the workers found different checkpoints to resume from" in output for output in outputs)


def test_the_plan_shows_the_strategy_and_this_tasks_role(monkeypatch):
    from trainers.run import strategy_line

    assert strategy_line("mirrored") == "strategy mirrored: one process"
    monkeypatch.setenv("TF_CONFIG", tf_config([1111, 2222], 1))
    assert strategy_line("multi_worker") == ("strategy multi_worker: 2 workers from TF_CONFIG, this task worker[1] = "
                                             "worker (writes to its scratch directory); waits up to 120 s for "
                                             "its peers")
    monkeypatch.setenv("TF_CONFIG", "[]")
    with pytest.raises(ClusterError, match="no 'cluster' object"):
        strategy_line("multi_worker")


def test_sparta_train_with_a_malformed_tf_config_is_one_line_and_writes_nothing(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cli_config(tmp_path / "run")))
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", TF_CONFIG='{"cluster": {"worker": ["a:1"]}}')
    result = subprocess.run([sys.executable, "-m", "trainers", "--config", str(path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: TF_CONFIG: task=None must be {'type': one of ['worker'], 'index': int}; each host sets its own task"]
    assert not (tmp_path / "run").exists()
