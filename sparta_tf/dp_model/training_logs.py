"""Which of ``fit``'s logs are noiseless statistics of the private batches, and the callbacks that act on them.

Keras hands every callback the batch's and the epoch's logs. Their training metrics (``loss``, the
compiled metrics, ``non_finite``) are means and counts over the sampled examples without noise, so what a
callback decides from them (stop, change the learning rate, keep another epoch's weights, name a file)
feeds the private batches into the release outside the guarantee. The other keys are not private:
``epsilon`` and ``trainable_fraction`` are data-independent or DP, a learning rate comes from its
schedule, and the validation metrics (``val_*`` keys, and every key of the logs of ``on_test_*`` hooks)
are of data outside the training set, unless the validation data holds training examples
(:func:`validation_holds_training_examples`).

* Keras's callbacks whose behaviour is known are judged by their arguments (:func:`acting_reasons`): a
  ``monitor``, a best-only ``ModelCheckpoint``, a checkpoint file name that formats a metric,
  ``TerminateOnNaN``;
* every other callback of the user's reads its logs through :class:`WatchedLogs`
  (:func:`watched_callbacks`): its first read of a private key marks the run not private, or, for a
  callback the user declared logging-only (:func:`logging_only`), records a ledger caveat.

What a callback reads another way (``model.history``, a metric object's ``result()``) is not seen; the
guarantee does not cover decisions made from it either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import string
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf

VALIDATION_PREFIX = "val_"
PUBLIC_KEYS = frozenset({"epsilon", "trainable_fraction", "lr", "learning_rate"})
"""Logged keys that are not statistics of the private data: the ledger's epsilon, the trainable share of
the weights (chosen by a DP mechanism or by no data) and the learning rate (its schedule)."""

_CALLBACKS = tf.keras.callbacks
MONITORING = (_CALLBACKS.EarlyStopping, _CALLBACKS.ReduceLROnPlateau, _CALLBACKS.ModelCheckpoint)
"""Keras callbacks that act on the metric they monitor (judged by :func:`acting_reasons`)."""

KNOWN = (*MONITORING, _CALLBACKS.TerminateOnNaN, _CALLBACKS.History, _CALLBACKS.ProgbarLogger,
         _CALLBACKS.CSVLogger, _CALLBACKS.TensorBoard, _CALLBACKS.RemoteMonitor, _CALLBACKS.LearningRateScheduler,
         _CALLBACKS.BackupAndRestore, *([_CALLBACKS.BaseLogger] if hasattr(_CALLBACKS, "BaseLogger") else []))
"""Keras callbacks whose use of the logs is known: they only log them (History, progress bars, CSV,
TensorBoard, a remote monitor), never read them (a schedule, backups), or act as their arguments say
(:func:`acting_reasons`). Exact types: a subclass may read more, so it is watched."""

OWN = {("sparta_tf.callbacks", "NonFiniteGuard")}
"""sparta-tf's callbacks a user passes to ``fit`` whose use of the logs is known: ``NonFiniteGuard`` stops
on the weights (the logged loss only says when to look at them)."""

HOOKS = {hook: hook.startswith(("on_test", "on_predict")) for hook in (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
    "on_train_batch_end", "on_batch_begin", "on_batch_end", "on_test_begin", "on_test_end",
    "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
    "on_predict_batch_begin", "on_predict_batch_end")}
"""Each Keras hook that gets logs -> whether they are an evaluation's (fit's validation) rather than
training's."""

_LOGGING_ONLY = "_sparta_logging_only"


@dataclasses.dataclass(frozen=True)
class LogKeys:
    """Which logged keys are noiseless statistics of the private training batches."""

    validation_holds_training_examples: bool = False

    def private(self, key: str, evaluating: bool = False) -> bool:
        """Whether ``key`` of a training hook's logs (an evaluation's: ``evaluating``) is private."""
        if key in PUBLIC_KEYS:
            return False
        if evaluating or key.startswith(VALIDATION_PREFIX):
            return self.validation_holds_training_examples
        return True



def describe_key(key: str, evaluating: bool = False) -> str:
    """A private ``key`` named for a reason: a training metric, or validation on training examples."""
    if evaluating or key.startswith(VALIDATION_PREFIX):
        return f"the validation metric {key!r}, computed on validation data that holds training examples"
    return f"the training metric {key!r}, a noiseless statistic of the private batches"


def check_metric_names(metrics, output_names) -> None:
    """One line when a compiled metric or an output is named ``val_...``: its training values would be logged
    under a validation key, which the checks of this module could not tell from a validation metric."""
    names = [name for name in (*tf.nest.flatten(metrics), *(output_names or ()))
             if isinstance(name, str)] + [getattr(metric, "name", None) or getattr(metric, "__name__", None)
                                          for metric in tf.nest.flatten(metrics) if not isinstance(metric, str)]
    for name in names:
        if isinstance(name, str) and name.startswith(VALIDATION_PREFIX):
            raise ValueError(f"the metric or output {name!r} starts with {VALIDATION_PREFIX!r}, which Keras uses for "
                             "validation metrics: its training values would pass for validation ones in the privacy "
                             "checks of callbacks; rename it")


def logging_only(callback: tf.keras.callbacks.Callback) -> tf.keras.callbacks.Callback:
    """Declares that ``callback`` only logs what it reads from ``fit``'s logs (a metrics logger such as
    W&B's or MLflow's): its reads of training metrics are then recorded as a ledger caveat (the guarantee
    assumes it changes nothing in training from them) instead of marking the run not private.
    Returns ``callback``."""
    setattr(callback, _LOGGING_ONLY, True)
    return callback


def is_logging_only(callback) -> bool:
    return bool(getattr(callback, _LOGGING_ONLY, False))


def is_known(callback) -> bool:
    """Whether ``callback``'s use of the logs is known (:data:`KNOWN`, :data:`OWN`: exact types)."""
    kind = type(callback)
    return kind in KNOWN or (kind.__module__, kind.__qualname__) in OWN


# ----------------------------------------------------------------- callbacks judged by their arguments


def acting_reasons(callbacks: list, keys: LogKeys) -> list[str]:
    """One reason per known callback whose decisions read a private key (:class:`LogKeys`): a monitoring
    callback (``EarlyStopping``, ``ReduceLROnPlateau``, a best-only ``ModelCheckpoint``) on a private
    metric, a ``ModelCheckpoint`` whose file names format one (the names are released with the
    checkpoints), and ``TerminateOnNaN``, which reads the loss of every batch."""
    reasons = []
    for callback in callbacks:
        monitor = getattr(callback, "monitor", None)
        acts = not isinstance(callback, _CALLBACKS.ModelCheckpoint) or getattr(callback, "save_best_only", False)
        if isinstance(callback, MONITORING) and acts and isinstance(monitor, str) and keys.private(monitor):
            reasons.append(f"{type(callback).__name__}(monitor={monitor!r}) acts on {describe_key(monitor)}; monitor a "
                           "validation metric of data outside the private training set, or leave it out")
        if isinstance(callback, _CALLBACKS.ModelCheckpoint):
            reasons += [f"ModelCheckpoint's file names format {describe_key(field)}, and the names are released with "
                        "the checkpoints; leave it out of filepath (epoch and val_ metrics are fine)"
                        for field in _format_fields(str(callback.filepath))
                        if field not in ("epoch", "batch") and keys.private(field)]
        if isinstance(callback, _CALLBACKS.TerminateOnNaN):
            reasons.append("TerminateOnNaN stops on the training loss, a noiseless mean over the sampled examples "
                           "(one the DP step dropped as non-finite included), so one example can decide when the run "
                           "stops; use sparta_tf.NonFiniteGuard, which stops on the weights")
    return reasons


def _format_fields(filepath: str) -> list[str]:
    """The names ``filepath.format(...)`` reads (``{loss:.2f}`` -> ``loss``)."""
    try:
        parsed = list(string.Formatter().parse(filepath))
    except ValueError:
        return []
    return [field.split(".")[0].split("[")[0] for _, field, _, _ in parsed if field]


# ------------------------------------------------------------------- validation data


def validation_holds_training_examples(x, validation_data) -> bool | None:
    """Whether an example of the validation inputs equals a training input (byte for byte, in the training
    arrays' dtypes); None when either is not arrays (a ``tf.data.Dataset``: not checked)."""
    if x is None or validation_data is None or isinstance(x, tf.data.Dataset):
        return None
    if isinstance(validation_data, tf.data.Dataset) or not isinstance(validation_data, (tuple, list)):
        return None
    x_val = validation_data[0]
    train_leaves, val_leaves = tf.nest.flatten(x), tf.nest.flatten(x_val)
    if len(train_leaves) != len(val_leaves):
        return False
    dtypes = [np.asarray(leaf).dtype for leaf in train_leaves]
    seen = _row_digests(train_leaves, dtypes)
    return any(digest in seen for digest in _row_digests(val_leaves, dtypes))


def _row_digests(leaves: list, dtypes: list) -> set[bytes]:
    """A digest of each example (row) of ``leaves``, each leaf cast to its training dtype."""
    arrays = [np.ascontiguousarray(np.asarray(leaf).astype(dtype, copy=False)) for leaf, dtype in zip(leaves, dtypes)]
    digests = set()
    for row in range(len(arrays[0])):
        digest = hashlib.blake2b(digest_size=16)
        for array in arrays:
            digest.update(array[row].tobytes())
        digests.add(digest.digest())
    return digests


# ------------------------------------------------------------------- watched callbacks


class WatchedLogs(dict):
    """A callback's copy of the logs that reports each value it reads (``on_read(key)``): indexing, ``get``,
    ``values``/``items``, copies (``dict(logs)``, ``{**logs}``, ``copy``, ``copy.copy``, ``json.dumps``),
    ``repr``, ``pop``. The keys alone (``in``, ``len``, ``keys``, iterating) read no value."""

    def __init__(self, logs: dict, on_read: Callable[[str], None]):
        super().__init__(logs)
        self._on_read = on_read

    def _read_all(self) -> None:
        for key in super().keys():
            self._on_read(key)

    def __getitem__(self, key):
        self._on_read(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        if key in self:
            self._on_read(key)
        return super().get(key, default)

    def __iter__(self) -> Iterator:  # not dict's iterator: dict(logs) and {**logs} then read via __getitem__
        return iter(list(super().keys()))

    def values(self):
        self._read_all()
        return super().values()

    def items(self):
        self._read_all()
        return super().items()

    def copy(self) -> dict:
        self._read_all()
        return dict(super().items())

    def pop(self, key, *default):
        if key in self:
            self._on_read(key)
        return super().pop(key, *default)

    def popitem(self):
        key, value = super().popitem()
        self._on_read(key)
        return key, value

    def setdefault(self, key, default=None):
        if key in self:
            self._on_read(key)
        return super().setdefault(key, default)

    def __repr__(self) -> str:
        self._read_all()
        return super().__repr__()

    __str__ = __repr__

    def __eq__(self, other) -> bool:
        self._read_all()
        return super().__eq__(other)

    __hash__ = None  # as dict's

    def __or__(self, other):
        return self.copy() | other

    def __ror__(self, other):
        return other | self.copy()

    def __reduce_ex__(self, protocol):
        return dict, (self.copy(),)


@contextlib.contextmanager
def watched_callbacks(callbacks: list, keys: LogKeys, on_private_read: Callable[[Any, str], None]):
    """Within the block, each of ``callbacks`` whose use of the logs is not known (:func:`is_known`) reads
    them through :class:`WatchedLogs`: ``on_private_read(callback, what)`` at each read of a private key
    (:class:`LogKeys`; ``what``: :func:`describe_key`). The hooks a callback implements are wrapped on the instance (its type, and so
    Keras's checks of it, stay as they are) and put back afterwards; what a hook writes to its logs
    reaches the later callbacks as before."""
    patched = []
    try:
        for callback in callbacks:
            if is_known(callback):
                continue
            for hook, evaluating in HOOKS.items():
                method = getattr(callback, hook, None)
                if method is None or getattr(method, "_is_default", False):
                    continue
                own = vars(callback).get(hook, _ABSENT)
                read = functools.partial(_report, on_private_read, callback, keys, evaluating)
                setattr(callback, hook, _watching(method, read))
                patched.append((callback, hook, own))
        yield
    finally:
        for callback, hook, own in reversed(patched):
            if own is _ABSENT:
                delattr(callback, hook)
            else:
                setattr(callback, hook, own)


_ABSENT = object()


def _report(on_private_read, callback, keys: LogKeys, evaluating: bool, key) -> None:
    if isinstance(key, str) and keys.private(key, evaluating):
        on_private_read(callback, describe_key(key, evaluating))


def _watching(method, read: Callable[[str], None]):
    """``method`` (a hook) called with its logs as :class:`WatchedLogs`; their writes copied back."""
    @functools.wraps(method)
    def hook(*args, **kwargs):
        if isinstance(kwargs.get("logs"), dict):
            logs = kwargs["logs"]
            kwargs["logs"] = watched = WatchedLogs(logs, read)
        elif args and isinstance(args[-1], dict):
            logs = args[-1]
            args = (*args[:-1], WatchedLogs(logs, read))
            watched = args[-1]
        else:
            return method(*args, **kwargs)
        try:
            return method(*args, **kwargs)
        finally:
            logs.update(dict.items(watched))
    return hook


def private_read_marker(ledger) -> Callable[[Any, str], None]:
    """``on_private_read`` for :func:`watched_callbacks` that records in ``ledger``, once per callback: a
    non-private reason (with a warning), or a caveat for a callback declared :func:`logging_only`."""
    seen = set()

    def mark(callback, what: str) -> None:
        if id(callback) in seen:
            return
        seen.add(id(callback))
        name = type(callback).__name__
        if is_logging_only(callback):
            ledger.record_caveat(f"callback {name} reads {what}; it was declared logging-only "
                                 "(sparta_tf.logging_only), so the guarantee assumes it changes nothing in training "
                                 "from what it reads")
            return
        reason = (f"callback {name} read {what}, so what it does with it (stop, change the learning "
                  "rate, keep weights) is outside the guarantee; decide from validation metrics or 'epsilon', or wrap "
                  "a callback that only logs in sparta_tf.logging_only(callback)")
        ledger.record_nonprivate(reason)
        warnings.warn(reason, stacklevel=2)
    return mark
