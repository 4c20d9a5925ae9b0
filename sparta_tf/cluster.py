"""The cluster of a multi-worker run: ``TF_CONFIG`` parsed and checked, and the wait for the peers.

* :func:`parse_tf_config`: ``TF_CONFIG`` (TensorFlow's cluster convention)
  checked, with a one-line error naming the problem and the fix;
* :func:`wait_for_peers`: every peer must answer on its port (a waiting
  worker's greeting or a TensorFlow server) before ``deadline_s`` (connect
  and read timeouts, never a hang), checked before TensorFlow's collective
  set-up, which waits for the cluster without a deadline;
  ``$SPARTA_PEER_TIMEOUT_S`` sets the deadline (120 s);
* :func:`answering_on_own_port`: this task's greeting meanwhile.

Standard library only: the config checker and the dry run use it without TensorFlow's set-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import threading
import time
from typing import Any

TASK_TYPES = ("chief", "worker")


class ClusterError(ValueError):
    """A malformed or unreachable cluster; the message is one line naming the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The parsed ``TF_CONFIG``: ``{"cluster": {"worker": [...], "chief": [...]}, "task": {...}}``."""

    jobs: dict[str, list[str]]
    task_type: str
    task_index: int

    @property
    def address(self) -> str:
        return self.jobs[self.task_type][self.task_index]

    @property
    def peers(self) -> list[tuple[str, int, str]]:
        """``(job, index, "host:port")`` of every other task."""
        return [(job, i, a) for job, addresses in self.jobs.items() for i, a in enumerate(addresses)
                if (job, i) != (self.task_type, self.task_index)]

    @property
    def num_workers(self) -> int:
        return sum(len(a) for a in self.jobs.values())

    @property
    def is_chief(self) -> bool:
        """TF's convention: the ``chief`` task, or worker 0 when the cluster has no chief."""
        if "chief" in self.jobs:
            return self.task_type == "chief"
        return self.task_index == 0


_FIX = "set TF_CONFIG to e.g. '{\"cluster\": {\"worker\": [\"host1:12345\", \"host2:12345\"]}, " \
       "\"task\": {\"type\": \"worker\", \"index\": 0}}'"


def _split_address(address: Any, where: str) -> tuple[str, int]:
    if not isinstance(address, str) or ":" not in address:
        raise ClusterError(f"TF_CONFIG: {where}={address!r} is not 'host:port'; {_FIX}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"TF_CONFIG: {where}={address!r} is not 'host:port' with a port in 1..65535; {_FIX}")
    return host, int(port)


def parse_tf_config(text: str | None) -> Cluster:
    """Checks ``TF_CONFIG`` and returns the cluster; :class:`ClusterError` (one line) when malformed."""
    if not text:
        raise ClusterError(f"training.strategy=multi_worker needs the TF_CONFIG environment variable; {_FIX}")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ClusterError(f"TF_CONFIG is not JSON ({error.msg} at char {error.pos}); {_FIX}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ClusterError(f"TF_CONFIG has no 'cluster' object; {_FIX}")
    jobs = config["cluster"]
    unknown = sorted(set(jobs) - set(TASK_TYPES))
    if unknown:
        raise ClusterError(f"TF_CONFIG: cluster job(s) {unknown} are not supported (only {list(TASK_TYPES)}); {_FIX}")
    if not jobs.get("worker") and not jobs.get("chief"):
        raise ClusterError(f"TF_CONFIG: cluster lists no 'worker' addresses; {_FIX}")
    seen: dict[str, str] = {}
    for job, addresses in jobs.items():
        if not isinstance(addresses, list):
            raise ClusterError(f"TF_CONFIG: cluster.{job} must be a list of 'host:port'; {_FIX}")
        if job == "chief" and len(addresses) != 1:
            raise ClusterError(f"TF_CONFIG: cluster.chief must list exactly one address, not {len(addresses)}")
        for i, address in enumerate(addresses):
            _split_address(address, f"cluster.{job}[{i}]")
            if address in seen:
                raise ClusterError(f"TF_CONFIG: {address} is listed twice ({seen[address]} and {job}[{i}]); "
                                   "give every task its own port")
            seen[address] = f"{job}[{i}]"
    task = config.get("task")
    if not isinstance(task, dict) or task.get("type") not in jobs or not isinstance(task.get("index"), int) \
            or isinstance(task.get("index"), bool):
        raise ClusterError(f"TF_CONFIG: task={task!r} must be {{'type': one of {sorted(jobs)}, 'index': int}}; "
                           "each host sets its own task")
    if not 0 <= task["index"] < len(jobs[task["type"]]):
        raise ClusterError(f"TF_CONFIG: task.index={task['index']} is out of range for the "
                           f"{len(jobs[task['type']])} {task['type']} address(es)")
    return Cluster({k: list(v) for k, v in jobs.items() if v}, task["type"], task["index"])


GREETING = b"sparta-tf worker waiting for its peers\n"
"""What a worker's port answers while it waits for its peers (:func:`answering_on_own_port`)."""

_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def _answers_as_peer(sock: socket.socket) -> bool:
    """Whether the connected ``sock`` is a peer: a worker waiting in :func:`make_strategy` (it sends
    :data:`GREETING`) or one whose TensorFlow server is up (gRPC: an HTTP/2 server answers the client
    preface with a SETTINGS frame, type 4 on stream 0). Anything else (another service on that port)
    would make TensorFlow's set-up wait for ever."""
    data = b""
    try:
        sock.sendall(_HTTP2_PREFACE)
        while len(data) < len(GREETING) and (GREETING.startswith(data) or len(data) < 9):
            chunk = sock.recv(len(GREETING) - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:  # a read timeout or a reset: judged on what came
        pass
    if data.startswith(GREETING):
        return True
    return len(data) >= 9 and data[3] == 0x04 and data[5:9] == b"\x00\x00\x00\x00"


def wait_for_peers(cluster: Cluster, deadline_s: float = 120.0, connect_timeout_s: float = 2.0) -> None:
    """Returns once every peer answers (:func:`_answers_as_peer`); :class:`ClusterError` after ``deadline_s``.

    Workers start at different times, so a refused connection is retried
    until the deadline; each attempt has a connect (and read) timeout, so an
    address that drops packets cannot hang the start.
    """
    end = time.monotonic() + deadline_s
    for job, index, address in cluster.peers:
        host, port = _split_address(address, f"cluster.{job}[{index}]")
        while True:
            try:
                with socket.create_connection((host, port), timeout=connect_timeout_s) as sock:
                    if _answers_as_peer(sock):
                        break
                    problem = "its port answers, but not as a sparta-train worker or a TensorFlow server"
            except OSError as error:
                problem = error.strerror or str(error)
            if time.monotonic() >= end:
                raise ClusterError(
                    f"cluster peer {job}[{index}] at {address} is unreachable after {deadline_s:g} s "
                    f"({problem}); start every task listed in TF_CONFIG or fix its address")
            time.sleep(0.2)


PEER_TIMEOUT_ENV = "SPARTA_PEER_TIMEOUT_S"
"""Environment variable: seconds a worker waits for its peers at start (default 120)."""

DEFAULT_PEER_TIMEOUT_S = 120.0


def peer_timeout_s() -> float:
    """The peer deadline: ``$SPARTA_PEER_TIMEOUT_S`` (seconds > 0) or :data:`DEFAULT_PEER_TIMEOUT_S`."""
    text = os.environ.get(PEER_TIMEOUT_ENV)
    if not text:
        return DEFAULT_PEER_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ClusterError(f"{PEER_TIMEOUT_ENV}={text!r} must be a number of seconds > 0; unset it for "
                           f"{DEFAULT_PEER_TIMEOUT_S:g} s")
    return value


@contextlib.contextmanager
def answering_on_own_port(cluster: Cluster):
    """Answers :data:`GREETING` on this task's port for the duration (a thread accepts), so that peers
    waiting in :func:`wait_for_peers` know this task is up before TensorFlow's server takes the port over.

    A port already in use is a :class:`ClusterError`: TensorFlow's server could not start there either.
    """
    _, port = _split_address(cluster.address, f"cluster.{cluster.task_type}[{cluster.task_index}]")
    try:
        if socket.has_dualstack_ipv6():
            server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            server = socket.create_server(("", port))
    except OSError as error:
        raise ClusterError(f"TF_CONFIG: this task {cluster.task_type}[{cluster.task_index}] cannot listen on "
                           f"{cluster.address} ({error.strerror or error}); stop what uses port {port} or give "
                           "this task a free port") from None
    server.settimeout(0.1)
    stop = threading.Event()

    def greet():
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:  # the accept timeout, or the socket closed
                continue
            with connection:
                try:
                    connection.settimeout(1.0)
                    connection.sendall(GREETING)
                    while connection.recv(256):  # the prober closes first: no TIME_WAIT on this port
                        pass
                except OSError:
                    pass

    greeter = threading.Thread(target=greet, name="sparta-peer-greeter", daemon=True)
    greeter.start()
    try:
        yield
    finally:
        stop.set()
        greeter.join()
        server.close()
