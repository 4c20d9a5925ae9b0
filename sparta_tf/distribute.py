"""Multi-worker DP-SGD on ``tf.distribute``: the cluster, the shared seed, each worker's share.

DP-SGD on ``W`` workers with ``R`` replicas in all runs *one* Poisson-subsampled
Gaussian mechanism per global step, exactly as on one device::

    B_t    = PoissonSample(seed, t)                       same on every worker (shared seed)
    B_t^r  = r-th of R contiguous slices of B_t (padded)  replica r's share, disjoint, covering B_t
    S_t    = all_reduce_sum_r  sum_{i in B_t^r} clip(g_i)  (collective over all workers)
    g~_t   = (S_t + N(0, sigma^2 C^2 I)) / (q n)          noise keyed by (seed, t): the same draw
                                                          on every replica, so it is added once

What this module holds (the rest is ``DPModel``'s ordinary step):

* :func:`make_strategy`: ``default`` / ``mirrored`` / ``multi_worker`` (the
  latter after :mod:`sparta_tf.cluster` parsed ``TF_CONFIG`` and every peer
  answered, so a missing peer is one line, never a hang);
* :func:`shared_seed`: the chief's seed broadcast to every worker (a secret
  seed drawn per worker would give different Poisson samples and noise);
* :func:`largest_over_workers`: one number every worker agrees on (the steps a
  killed run started, charged once the same on every worker's ledger);
* :func:`check_same_checkpoint`, :func:`check_same_step`: every worker resumes
  from the same checkpoint and step, or none starts;
* :func:`check_same_examples`: every worker holds the same training examples in
  the same order (the Poisson samples and groups are drawn by position), or none starts;
* :func:`replica_share`: the slice of a global Poisson batch a replica trains on;
* :func:`at_least_one_row`: an evaluation batch a replica got no example of, as one row of weight 0;
* :func:`is_chief`, :func:`worker_dir`: only the chief writes the run's files;
  other workers write to a scratch directory of their own.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import tensorflow as tf

from sparta_tf.backend import KERAS3
from sparta_tf.choices import STRATEGIES
from sparta_tf.cluster import (  # noqa: F401  (the cluster is part of this module's API)
    Cluster,
    ClusterError,
    answering_on_own_port,
    parse_tf_config,
    peer_timeout_s,
    wait_for_peers,
)

def _collective_strategy(options) -> tf.distribute.Strategy:
    """``MultiWorkerMirroredStrategy(communication_options=options)``, with SIGTERM's default action back.

    TensorFlow's collective set-up installs a SIGTERM handler of its own (its preemption notifier) that
    only notes the signal, so a worker would ignore ``kill`` for the rest of the run, even when blocked
    in a collective whose peer died; sparta-tf uses no preemption handling, so SIGTERM ends the process
    again (like ``kill -9``: ``--resume`` continues the run). The set-up itself holds the interpreter
    while it waits for the cluster, which :func:`wait_for_peers` makes short.
    """
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return strategy


def make_strategy(name: str, peer_deadline_s: float | None = None) -> tf.distribute.Strategy:
    """The ``tf.distribute`` strategy ``name`` (one of :data:`STRATEGIES`).

    ``multi_worker`` reads ``TF_CONFIG``; call it before any other TensorFlow
    op (TF's collectives are configured when the strategy is created). It
    first waits (at most ``peer_deadline_s``, default :func:`peer_timeout_s`)
    until every peer answers (:func:`wait_for_peers`), answering on its own
    port meanwhile (:func:`answering_on_own_port`), so that a missing peer is
    a one-line :class:`ClusterError` before TensorFlow's set-up starts: that
    set-up waits for the cluster without a deadline, deaf to SIGTERM and
    SIGINT. Afterwards SIGTERM ends the worker again (:func:`_collective_strategy`).
    """
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name != "multi_worker":
        raise ValueError(f"strategy={name!r} is not one of {STRATEGIES}")
    cluster = parse_tf_config(os.environ.get("TF_CONFIG"))
    deadline = peer_timeout_s() if peer_deadline_s is None else float(peer_deadline_s)
    with answering_on_own_port(cluster):
        wait_for_peers(cluster, deadline)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.AUTO)
    return _collective_strategy(options)


def cluster_of(strategy: tf.distribute.Strategy) -> Cluster | None:
    """The cluster of a multi-worker strategy, ``None`` for a single-process one."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    jobs = resolver.cluster_spec().as_dict()
    if not jobs:
        return None
    return Cluster({k: list(v) for k, v in jobs.items()}, resolver.task_type, int(resolver.task_id))


def is_multi_worker(strategy: tf.distribute.Strategy) -> bool:
    cluster = cluster_of(strategy)
    return cluster is not None and cluster.num_workers > 1


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process writes the run's files (always, without a cluster)."""
    cluster = cluster_of(strategy)
    return cluster is None or cluster.is_chief


def worker_dir(output_dir: str, strategy: tf.distribute.Strategy) -> str:
    """``output_dir`` on the chief; its sibling ``<output_dir>.worker-<type>-<index>`` on other workers.

    A non-chief worker keeps a complete run directory of its own there (lock,
    journal, checkpoints to resume from), outside the chief's, so that no
    file of the two ever collides even on a shared file system.
    """
    cluster = cluster_of(strategy)
    if cluster is None or cluster.is_chief:
        return output_dir
    return f"{os.path.normpath(output_dir)}.worker-{cluster.task_type}-{cluster.task_index}"


def shared_seed(strategy: tf.distribute.Strategy, seed: int) -> int:
    """The chief's 63-bit ``seed`` on every worker (a collective sum where only replica 0 contributes).

    The seed travels as two int32 halves summed in int64, which the CPU and
    GPU collectives both support; a single process gets ``seed`` back.
    """
    if not is_multi_worker(strategy):
        return seed
    halves = tf.constant([seed >> 32, seed & 0xFFFFFFFF], tf.int64)

    def contribution(replica):
        # only one replica is the chief's first: wrong if the chief has >1 local replica and replica 0
        # is not its own, which TF's replica numbering (chief first) rules out.
        first = tf.equal(replica, 0) if is_chief(strategy) else tf.constant(False)  # replica: a tensor when traced
        return tf.where(first, halves, tf.zeros_like(halves))

    result = _sum_over_replicas(strategy, contribution)
    return (int(result[0]) << 32) | int(result[1])


def _sum_over_replicas(strategy: tf.distribute.Strategy, contribution) -> Any:
    """``sum_r contribution(r)`` over every replica of every worker (an int64 all-reduce), as numpy.

    ``contribution(replica_id_in_sync_group)`` gives this process's tensor for
    one of its replicas; the sum collective is the one the CPU and GPU
    collectives both support for int64.
    """
    def contribute():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, contribution(ctx.replica_id_in_sync_group))

    return strategy.experimental_local_results(strategy.run(tf.function(contribute)))[0].numpy()


def replica_share(element: Any, replica: int | tf.Tensor, replicas: int) -> Any:
    """Replica ``replica``'s contiguous ``1/replicas`` slice of a global batch ``(x, y, w)``.

    The slices of all replicas are disjoint and cover the batch, so the
    all-reduced sum of their clipped gradients is the global batch's sum.
    The batch length (``k * P``) must be a multiple of ``replicas``.
    """
    def piece(t):
        length = tf.shape(t)[0]
        tf.debugging.assert_equal(length % replicas, 0, message="batch length is not a multiple of the "
                                  "number of replicas; use a physical_batch_size that is")
        size = length // replicas
        return t[replica * size:(replica + 1) * size]

    return tf.nest.map_structure(piece, element)


def per_worker_dataset_fn(global_dataset_fn):
    """A ``tf.keras.utils.experimental.DatasetCreator`` function: each worker's replicas' shares.

    ``global_dataset_fn()`` must build the *same* dataset of global batches on
    every worker (same seed, same start step). Worker ``w`` with ``L`` local
    replicas yields, per global step, the slices ``w L, ..., w L + L - 1``
    (one element per local replica, in order).
    """
    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        replicas = input_context.num_replicas_in_sync
        local = replicas // input_context.num_input_pipelines
        first = input_context.input_pipeline_id * local

        def shares(*element):
            pieces = [replica_share(element, first + r, replicas) for r in range(local)]
            return tf.data.Dataset.from_tensor_slices(
                tf.nest.map_structure(lambda *p: tf.stack(p), *pieces))

        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return global_dataset_fn().flat_map(shares).with_options(options)

    return dataset_fn


def agree_on_seed(strategy: tf.distribute.Strategy, seed: int | None, name: str = "seed") -> int:
    """The run seed every worker uses: the chief's (a fresh secret one when ``seed`` is None).

    A seed given explicitly must be the same on every worker; different seeds
    would give different Poisson samples and noise per worker, which the
    accountant does not cover, so they are refused.
    """
    from sparta_tf import random_streams

    resolved = random_streams.resolve_seed(seed)
    if not is_multi_worker(strategy):
        return resolved
    chief = shared_seed(strategy, resolved)
    if seed is not None and chief != resolved:
        raise ValueError(f"DPModel({name}=...) differs between workers; pass the same {name} to every worker "
                         "(or None: the chief's secret seed is then shared)")
    return chief


def for_fit(dataset: tf.data.Dataset, strategy: tf.distribute.Strategy):
    """What ``fit`` gets: ``dataset`` itself, or on several workers each worker's shares of it
    (:func:`per_worker_input`)."""
    if not is_multi_worker(strategy):
        return dataset
    return per_worker_input(strategy, per_worker_dataset_fn(lambda: dataset))


def per_worker_input(strategy: tf.distribute.Strategy, dataset_fn):
    """``fit``'s input built per worker by ``dataset_fn(input_context)``.

    Keras 2: a ``tf.keras.utils.experimental.DatasetCreator`` (Keras distributes it). Keras 3 has no
    ``DatasetCreator``; its ``fit`` takes a distributed dataset as it is, so the strategy builds one
    from the same function (``distribute_datasets_from_function``: the same per-replica elements).
    """
    if KERAS3:
        return strategy.distribute_datasets_from_function(dataset_fn)
    return tf.keras.utils.experimental.DatasetCreator(dataset_fn)


def local_batch(batch: Any) -> Any:
    """``batch`` as its first local replica sees it: each distributed value (``PerReplica``) replaced by
    its first local component, any other value unchanged. Same shapes and dtypes as every replica's part;
    no communication (what Keras 3 needs to build a model before its first step, see ``DPModel``)."""
    def first(value):
        return value.values[0] if isinstance(value, tf.distribute.DistributedValues) else value

    return tf.nest.map_structure(first, batch)


def at_least_one_row(x: Any, y: Any, weights: Any) -> tuple[Any, Any, Any]:
    """An evaluation batch, with one zero row of weight 0 added when it has no row; ``weights`` ones when None.

    Splitting a last batch of ``m`` examples over ``R > m`` replicas leaves some replica none, and Keras'
    ``GroupNormalization`` fails on an empty batch (its reshape infers a group size of 0). The added row
    counts in no metric or loss (compiled metrics are weighted, see ``DPModel.compile``); a batch with rows
    is unchanged but for the explicit weights, whose weighted means equal the unweighted ones.
    """
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    weights = tf.ones([rows], tf.float32) if weights is None else weights
    return _with_missing_row(x, rows), _with_missing_row(y, rows), _with_missing_row(weights, rows)


def inputs_with_one_row(x: Any) -> tuple[Any, tf.Tensor]:
    """``(x with one zero row added when it has no row, x's row count)``: a prediction batch as
    :func:`at_least_one_row` pads an evaluation batch; the caller keeps the first ``rows`` outputs."""
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    return _with_missing_row(x, rows), rows


def _with_missing_row(structure: Any, rows: tf.Tensor) -> Any:
    """Every tensor of ``structure`` with one zero row appended when ``rows`` is 0 (unchanged otherwise)."""
    missing = tf.maximum(1 - rows, 0)  # 1 for an empty batch, else 0

    def pad(tensor):
        tensor = tf.convert_to_tensor(tensor)
        return tf.concat([tensor, tf.zeros(tf.concat([[missing], tf.shape(tensor)[1:]], 0), tensor.dtype)], 0)

    return None if structure is None else tf.nest.map_structure(pad, structure)


def reducible_logs(logs: Any, strategy: tf.distribute.Strategy) -> Any:
    """A step's outputs (``{"loss": ..., metrics}``) as Keras can reduce them over several workers.

    Keras 3 reduces each output of a multi-worker step with ``strategy.reduce("MEAN", v, axis=0)``,
    which needs an axis: a scalar becomes shape ``[1]`` (the mean over the replicas' ``[1]``-shaped
    values is the mean scalar). Unchanged on Keras 2 (it takes the first replica's) and in one process.
    """
    if not (KERAS3 and is_multi_worker(strategy)):
        return logs
    return tf.nest.map_structure(lambda v: tf.reshape(v, [1]) if len(v.shape) == 0 else v, logs)


def largest_over_workers(strategy: tf.distribute.Strategy, value: int) -> int:
    """``max_w value_w`` over the workers (``value`` itself in a single process).

    Every replica puts its process's ``value`` at its own index of a vector
    of length ``R``; the all-reduced sum holds every worker's value.
    """
    if not is_multi_worker(strategy):
        return value
    replicas = strategy.num_replicas_in_sync
    values = _sum_over_replicas(strategy, lambda replica: tf.cast(tf.one_hot(replica, replicas), tf.int64) * value)
    return int(values.max())


def _equal_on_every_replica(strategy: tf.distribute.Strategy, values: list[int]) -> bool:
    """Whether every replica holds ``values`` (ints in ``[0, 2**16)``, so that the int64 sum of ``R`` squares
    cannot overflow below ``R = 2**31``; one collective): for each value, ``R sum_r v_r^2 = (sum_r v_r)^2``
    iff every ``v_r`` is equal (Cauchy-Schwarz)."""
    moments = tf.constant([m for value in values for m in (value, value * value)], tf.int64)
    sums = _sum_over_replicas(strategy, lambda replica: moments)
    replicas = strategy.num_replicas_in_sync
    return all(replicas * int(sums[2 * i + 1]) == int(sums[2 * i]) ** 2 for i in range(len(values)))


def check_same_examples(strategy: tf.distribute.Strategy, fingerprint: str) -> None:
    """:class:`ClusterError` unless every worker's training examples have ``fingerprint`` (a hex digest of
    the arrays in order, :func:`sparta_tf.privacy.array_inputs.examples_fingerprint`).

    Each worker gathers its share of a step by position from its own arrays, so workers whose arrays
    differ (other examples, another order, another split) would put one example in several workers'
    shares of a step, or sample it at another rate than ``q``: not the mechanism the ledger charges.
    """
    if not is_multi_worker(strategy):
        return
    digest, bits = int(fingerprint, 16), 4 * len(fingerprint)  # the same count of chunks on every worker
    chunks = [(digest >> (16 * i)) & 0xFFFF for i in range(-(-bits // 16))]
    if not _equal_on_every_replica(strategy, chunks):
        raise ClusterError("the workers hold different training examples (other examples, another order or another "
                           "data split); give every worker the same arrays in the same order (sparta-train shares the "
                           "chief's split key), then restart every worker")


def _mean_unless_equal(strategy: tf.distribute.Strategy, value: int) -> float | None:
    """``None`` when every worker holds ``value``, else the mean over the replicas (one collective).

    Cauchy-Schwarz: ``R sum_r v_r^2 = (sum_r v_r)^2`` iff every ``v_r`` is equal.
    """
    moments = tf.constant([value, value * value], tf.int64)
    total, squares = _sum_over_replicas(strategy, lambda replica: moments)
    replicas = strategy.num_replicas_in_sync
    return None if replicas * int(squares) == int(total) ** 2 else int(total) / replicas


def check_same_checkpoint(strategy: tf.distribute.Strategy, epoch: int | None) -> None:
    """:class:`ClusterError` unless every worker resumes from the checkpoint of ``epoch`` (``None``:
    every worker starts without one).

    A worker that starts fresh runs the mechanisms before training (and
    their collectives) that a restored worker skips, so workers that
    disagree would pair unrelated collectives and could hang; called before
    the first collective that only one of the paths makes, so they meet here
    and stop.
    """
    if not is_multi_worker(strategy):
        return
    mean = _mean_unless_equal(strategy, -1 if epoch is None else epoch)
    if mean is not None:
        mine = "none" if epoch is None else f"epoch {epoch}"
        raise ClusterError(f"the workers found different checkpoints to resume from (this one: {mine}); restart "
                           "every worker with --resume from copies of the same epoch's checkpoint, or start over "
                           "in fresh output directories")


def check_same_step(strategy: tf.distribute.Strategy, step: int) -> None:
    """:class:`ClusterError` unless every worker is at global step ``step`` (e.g. after ``--resume``).

    Workers restored at different steps would train on shares of different
    Poisson samples in one all-reduce, which is not the mechanism the
    accountant charges; this refuses to start instead.
    """
    if not is_multi_worker(strategy):
        return
    mean = _mean_unless_equal(strategy, step)
    if mean is not None:
        raise ClusterError(f"the workers restored different checkpoints (this one at step {step}, the mean "
                           f"{mean:g}); restart every worker with --resume from copies of the "
                           "same epoch's checkpoint, or start over in fresh output directories")
